"""The parallel layout: how the ranks of a job split along named dimensions. Pure.

A :class:`Layout` names one size per dimension of :data:`DIMENSIONS`
(``pipeline``, ``replicate``, ``shard``, ``expert``, ``context``, ``tensor``);
their product is the world size. The ranks form an N-D grid in row-major order
over the dimensions in that order, PyTorch's ``init_device_mesh`` order and
torchtitan's (``pp, dp_replicate, dp_shard, ep, cp, tp``): a rank's coordinate
along a dimension is ``rank // stride % size``, its stride the product of the
sizes after it. The tensor dimension is innermost, so a tensor-parallel group
is a run of consecutive ranks (one node's GPUs, where its per-layer
collectives are cheapest); the pipeline dimension is outermost, so each
pipeline stage is a contiguous block of ranks and only activations cross
between blocks.

The data-parallel ranks are the ``replicate`` x ``shard`` x ``expert`` part:
the ranks that differ only there read different batches. The ``expert``
dimension is data-parallel for every parameter but the experts' (torchtitan
borrows its ``ep`` ranks from ``dp_shard`` the same way): the ranks of an
expert group read different batches, hold the rest of the model as data
parallelism holds it, and split each mixture-of-experts layer's experts
between them, each token sent to its experts' ranks and back
(``faccel._loop._strategies._experts``). It sits innermost of the data dimensions, so an
expert group is a run of consecutive ranks (its all-to-all stays on a node).
Ranks along ``context`` read
the same batch (each its slice of every sequence), ranks along ``tensor`` the
same batch whole, ranks along ``pipeline`` the same batch at another stage.

Nothing here unpacks a fixed number of dimensions: every function walks
:data:`DIMENSIONS` by name, so a new dimension is one more name there.
Everything is arithmetic on integers; ``faccel._dist._mesh`` builds the
DeviceMesh and process groups these functions describe.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import attrs

from faccel._choices import Strategy
from faccel.errors import ArgumentValueError

__all__ = [
    "DATA_DIMENSIONS",
    "DIMENSIONS",
    "Layout",
    "default_layout",
    "layout_problem",
    "parse_layout",
    "strategy_for",
]

#: The dimensions of a layout, outermost first: the names of the DeviceMesh's dimensions.
DIMENSIONS: tuple[str, ...] = ("pipeline", "replicate", "shard", "expert", "context", "tensor")

#: The dimensions the data is dealt over: ranks that differ only here read different batches.
DATA_DIMENSIONS: tuple[str, ...] = ("replicate", "shard", "expert")

# Always written out by str() and repr() (the layouts that existed before pipeline and context).
_ALWAYS_SHOWN = ("replicate", "shard", "tensor")


def _size(_: object, attribute: attrs.Attribute, value: object) -> None:  # type: ignore[type-arg]
    if type(value) is not int or value < 1:
        msg = f"Layout.{attribute.name} must be an int >= 1, got {value!r}"
        raise ArgumentValueError(msg)


@attrs.frozen(repr=False)
class Layout:
    """How the ranks split: pipeline stages x replicas x shards x expert ranks x context ranks x tensor ranks.

    * ``pipeline``: stages the model is cut into (``torch.distributed.pipelining``);
      each stage is held by ``world_size / pipeline`` ranks (outermost).
    * ``replicate``: groups that each hold a whole copy of (their stage of) the
      model (DDP; with ``shard > 1``, HSDP: each replica sharded over its own ranks).
    * ``shard``: ranks a model's parameters are sharded over (FSDP2's ``fully_shard``).
    * ``expert``: ranks that split each mixture-of-experts layer's experts
      (expert parallelism: each holds ``experts / expert`` of them, tokens
      travel by all-to-all); data-parallel for the rest of the model.
    * ``context``: ranks that split each sequence (context parallelism: each
      holds a load-balanced slice of every sequence, attention by torch's
      ``context_parallel``) and see the same batches.
    * ``tensor``: ranks that split each layer's weights (tensor parallelism from
      a ``parallelize_module`` plan) and see the same batches (innermost).

    The data-parallel ranks are ``replicate * shard * expert``; the loaders deal the
    data over them only. ``replicate``, ``shard`` and ``tensor`` are also
    positional, in that order, as they were before the other dimensions.

    Raises:
        ArgumentValueError: A size that is not an int >= 1.

    Example:
        >>> layout = Layout(shard=2, tensor=2)
        >>> layout.world_size, layout.data_size, layout.coordinates(3), layout.data_rank(3)
        (4, 2, (0, 0, 1, 0, 0, 1), 1)
        >>> layout.members("tensor", 3), layout.members("shard", 3)
        ((2, 3), (1, 3))
        >>> str(layout), str(Layout(pipeline=2, shard=2, tensor=2))
        ('replicate=1,shard=2,tensor=2', 'pipeline=2,replicate=1,shard=2,tensor=2')
        >>> Layout(pipeline=2, shard=2).coordinate("pipeline", 3)
        1
        >>> Layout(shard=2, expert=2).world_size, Layout(shard=2, expert=2).members("expert", 2)
        (4, (2, 3))
    """

    replicate: int = attrs.field(default=1, validator=_size)
    shard: int = attrs.field(default=1, validator=_size)
    tensor: int = attrs.field(default=1, validator=_size)
    pipeline: int = attrs.field(default=1, validator=_size, kw_only=True)
    context: int = attrs.field(default=1, validator=_size, kw_only=True)
    expert: int = attrs.field(default=1, validator=_size, kw_only=True)

    def _shown(self) -> list[tuple[str, int]]:
        sizes = self.sizes
        return [(name, sizes[name]) for name in DIMENSIONS if name in _ALWAYS_SHOWN or sizes[name] != 1]

    def __str__(self) -> str:
        return ",".join(f"{name}={size}" for name, size in self._shown())

    def __repr__(self) -> str:
        # The dimensions that existed first always, the others when used: the repr of every
        # earlier layout reads as it did.
        fields = dict(self._shown())
        order = [*_ALWAYS_SHOWN, *(name for name in DIMENSIONS if name not in _ALWAYS_SHOWN)]
        return "Layout(" + ", ".join(f"{name}={fields[name]}" for name in order if name in fields) + ")"

    @property
    def sizes(self) -> dict[str, int]:
        """Each dimension's size by name, in :data:`DIMENSIONS` order."""
        return {name: getattr(self, name) for name in DIMENSIONS}

    @property
    def shape(self) -> tuple[int, ...]:
        """The sizes in :data:`DIMENSIONS` order: the DeviceMesh's shape."""
        return tuple(getattr(self, name) for name in DIMENSIONS)

    def size(self, dimension: str) -> int:
        """The size of ``dimension``, by name (``"data"``: :attr:`data_size`).

        Raises:
            ArgumentValueError: An unknown dimension.
        """
        if dimension == "data":
            return self.data_size
        self._check_dimension(dimension)
        return int(getattr(self, dimension))

    @property
    def world_size(self) -> int:
        """Ranks the layout spans: the product of the sizes."""
        return _product(self.shape)

    @property
    def data_size(self) -> int:
        """Data-parallel ranks (``replicate * shard * expert``): how many ways each batch is dealt."""
        return _product(getattr(self, name) for name in DATA_DIMENSIONS)

    def _stride(self, dimension: str) -> int:
        after = DIMENSIONS[DIMENSIONS.index(dimension) + 1 :]
        return _product(getattr(self, name) for name in after)

    def coordinate(self, dimension: str, rank: int) -> int:
        """``rank``'s coordinate along ``dimension`` (named).

        Raises:
            ArgumentValueError: An unknown dimension, or ``rank`` not in ``[0, world_size)``.
        """
        self._check_dimension(dimension)
        self._check_rank(rank)
        return rank // self._stride(dimension) % int(getattr(self, dimension))

    def coordinates(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinates, one per dimension in :data:`DIMENSIONS` order.

        Raises:
            ArgumentValueError: ``rank`` is not in ``[0, world_size)``.
        """
        self._check_rank(rank)
        return tuple(rank // self._stride(name) % getattr(self, name) for name in DIMENSIONS)

    def rank_of(self, coordinates: Sequence[int] | Mapping[str, int]) -> int:
        """The rank at ``coordinates``: the inverse of :meth:`coordinates`.

        ``coordinates`` is a sequence in :data:`DIMENSIONS` order, or a mapping
        from dimension names to coordinates (a missing name is 0).

        Raises:
            ArgumentValueError: A coordinate outside its dimension, an unknown
                name, or a sequence of another length.
        """
        if isinstance(coordinates, Mapping):
            for name in coordinates:
                self._check_dimension(name)
            point = [coordinates.get(name, 0) for name in DIMENSIONS]
        else:
            point = list(coordinates)
            if len(point) != len(DIMENSIONS):
                msg = f"coordinates are one per dimension {list(DIMENSIONS)}, got {coordinates!r}"
                raise ArgumentValueError(msg)
        rank = 0
        for name, value in zip(DIMENSIONS, point, strict=True):
            size = getattr(self, name)
            if type(value) is not int or not 0 <= value < size:
                msg = f"{name} coordinate must be in [0, {size}), got {value!r}"
                raise ArgumentValueError(msg)
            rank = rank * size + value
        return rank

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of ``rank`` (in ``[0, data_size)``): which share of the data it reads.

        Raises:
            ArgumentValueError: ``rank`` is not in ``[0, world_size)``.
        """
        here = self.coordinates(rank)
        out = 0
        for name in DATA_DIMENSIONS:
            out = out * getattr(self, name) + here[DIMENSIONS.index(name)]
        return out

    def members(self, dimension: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dimension``, ascending.

        ``dimension`` is one of :data:`DIMENSIONS`, or ``"data"`` for the
        data-parallel group (:data:`DATA_DIMENSIONS` together): the ranks that
        share every other coordinate of ``rank``.

        Raises:
            ArgumentValueError: An unknown dimension, or a rank outside the layout.
        """
        along = DATA_DIMENSIONS if dimension == "data" else (dimension,)
        for name in along:
            self._check_dimension(name)
        here = dict(zip(DIMENSIONS, self.coordinates(rank), strict=True))
        points = [here]
        for name in along:
            points = [{**p, name: value} for p in points for value in range(getattr(self, name))]
        return tuple(sorted(self.rank_of(p) for p in points))

    def groups(self, dimension: str) -> tuple[tuple[int, ...], ...]:
        """Every group along ``dimension`` (or ``"data"``), each ascending, ordered by first rank.

        Together they partition the ranks: the groups a collective over
        ``dimension`` runs in, side by side.

        Raises:
            ArgumentValueError: An unknown dimension.
        """
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.members(dimension, rank), None)
        return tuple(seen)

    def _check_rank(self, rank: int) -> None:
        if type(rank) is not int or not 0 <= rank < self.world_size:
            msg = f"rank must be in [0, {self.world_size}) for layout {self}, got {rank!r}"
            raise ArgumentValueError(msg)

    @staticmethod
    def _check_dimension(dimension: str) -> None:
        if dimension not in DIMENSIONS:
            msg = f"dimension must be one of {[*DIMENSIONS, 'data']}, got {dimension!r}"
            raise ArgumentValueError(msg)


def _product(values: object) -> int:
    out = 1
    for value in values:  # type: ignore[attr-defined]
        out *= value
    return out


_ITEM = re.compile(r"\s*(" + "|".join(DIMENSIONS) + r")\s*=\s*([0-9]{1,6})\s*")


def parse_layout(text: str) -> Layout:
    """The :class:`Layout` that ``text`` spells, as ``str(layout)`` writes it; missing sizes are 1.

    Raises:
        ArgumentValueError: ``text`` is not ``name=size`` items separated by
            commas, names a dimension twice, or a size is below 1.

    Example:
        >>> parse_layout("shard=2, tensor=2")
        Layout(replicate=1, shard=2, tensor=2)
        >>> parse_layout(str(Layout(replicate=2, shard=4))) == Layout(2, 4)
        True
        >>> parse_layout("pipeline=2,shard=2,tensor=2").pipeline
        2
    """
    sizes: dict[str, int] = {}
    for item in text.split(","):
        match = _ITEM.fullmatch(item)
        if match is None or match.group(1) in sizes:
            msg = (
                f"a layout is written 'name=size' items, comma-separated, names from {list(DIMENSIONS)} "
                f"(e.g. 'pipeline=2,shard=2,tensor=2'; sizes >= 1, each name at most once, missing ones "
                f"are 1), got {text!r}"
            )
            raise ArgumentValueError(msg)
        sizes[match.group(1)] = int(match.group(2))
    return Layout(**sizes)


def default_layout(strategy: Strategy, world_size: int) -> Layout:
    """The layout a strategy means without one: DDP replicates over every rank, FSDP shards over them.

    Example:
        >>> default_layout("ddp", 4), default_layout("fsdp", 4)
        (Layout(replicate=4, shard=1, tensor=1), Layout(replicate=1, shard=4, tensor=1))
    """
    return Layout(shard=world_size) if strategy == "fsdp" else Layout(replicate=world_size)


def layout_problem(layout: Layout, world_size: int, strategy: Strategy) -> str:
    """What makes ``layout`` unusable for a job of ``world_size`` under ``strategy``; empty if nothing.

    Example:
        >>> layout_problem(Layout(shard=2, tensor=2), 4, "fsdp")
        ''
        >>> layout_problem(Layout(shard=2), 4, "fsdp")[:42]
        'layout replicate=1,shard=2,tensor=1 spans '
    """
    if layout.world_size != world_size:
        spelled = " x ".join(DIMENSIONS)
        return (
            f"layout {layout} spans {layout.world_size} ranks ({spelled}), but the "
            f"job has {world_size}; choose sizes whose product is the world size"
        )
    if strategy == "deepspeed" and layout.replicate != world_size:
        return (
            f"layout {layout} asks for shards, pipeline stages, experts, context or tensor parallelism, but "
            "strategy 'deepspeed' partitions over every rank itself (ZeRO); drop the layout, or use "
            "strategy='fsdp'"
        )
    if strategy == "ddp" and layout.shard > 1:
        return (
            f"layout {layout} shards parameters over {layout.shard} ranks, which strategy 'ddp' "
            "never does; use strategy='fsdp' (or shard=1)"
        )
    if strategy == "ddp" and layout.replicate > 1 and layout.expert > 1:
        return (
            f"layout {layout} averages experts over replicas, which DDP (leaving each rank's experts "
            "alone) cannot do; use strategy='fsdp' (HSDP: each block of experts averaged over its replicas)"
        )
    if strategy == "ddp" and layout.replicate > 1 and layout.replicate * layout.expert != world_size:
        return (
            f"layout {layout} replicates stages or tensor-parallel or context-parallel weights, "
            "which faccel does with FSDP2 (HSDP with shard=1), not DDP; use strategy='fsdp'"
        )
    return ""


def strategy_for(layout: Layout) -> str:
    """The strategy a layout asks for when none is given: DDP for replicas alone or expert ranks alone
    (expert parallelism alone keeps the rest of the model whole, as DDP does), else FSDP2 (replicas
    beside experts included: HSDP averages each block of experts over its replicas).

    Example:
        >>> strategy_for(Layout(replicate=4)), strategy_for(Layout(tensor=4)), strategy_for(Layout(expert=4))
        ('ddp', 'fsdp', 'ddp')
        >>> strategy_for(Layout(pipeline=2, replicate=2)), strategy_for(Layout(replicate=2, expert=2))
        ('fsdp', 'fsdp')
    """
    alone = layout.replicate == layout.world_size or layout.expert == layout.world_size
    return "ddp" if alone else "fsdp"
