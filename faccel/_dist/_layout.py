"""The parallel layout: how the ranks of a job split into replicas, shards and tensor-parallel groups. Pure.

A :class:`Layout` names three sizes whose product is the world size. The
ranks form a 3-D grid ``(replicate, shard, tensor)`` in row-major order, the
order of PyTorch's ``init_device_mesh``: ``rank = (r * shard + s) * tensor + t``.
The tensor dimension is innermost, so a tensor-parallel group is a run of
consecutive ranks (one node's GPUs, where its per-layer collectives are
cheapest), and the data-parallel rank of a process is ``rank // tensor``.

Everything here is arithmetic on integers; ``faccel._dist._mesh`` builds the
DeviceMesh and process groups these functions describe.
"""

from __future__ import annotations

import re

import attrs

from faccel.errors import ArgumentValueError

__all__ = ["DIMENSIONS", "Layout", "default_layout", "layout_problem", "parse_layout", "strategy_for"]

#: The dimensions of a layout, outermost first: the names of the DeviceMesh's dimensions.
DIMENSIONS: tuple[str, ...] = ("replicate", "shard", "tensor")


def _size(_: object, attribute: attrs.Attribute, value: object) -> None:  # type: ignore[type-arg]
    if type(value) is not int or value < 1:
        msg = f"Layout.{attribute.name} must be an int >= 1, got {value!r}"
        raise ArgumentValueError(msg)


@attrs.frozen
class Layout:
    """How the ranks split: ``replicate`` x ``shard`` data-parallel ranks, each batch on ``tensor`` ranks.

    * ``replicate``: groups that each hold a whole copy of the model (DDP; with
      ``shard > 1``, HSDP: each replica sharded over its own ranks).
    * ``shard``: ranks a model's parameters are sharded over (FSDP2's ``fully_shard``).
    * ``tensor``: ranks that split each layer's weights (tensor parallelism from
      a ``parallelize_module`` plan) and see the same batches.

    The data-parallel ranks are ``replicate * shard``; the loaders deal the
    data over them only.

    Raises:
        ArgumentValueError: A size that is not an int >= 1.

    Example:
        >>> layout = Layout(shard=2, tensor=2)
        >>> layout.world_size, layout.data_size, layout.coordinates(3), layout.data_rank(3)
        (4, 2, (0, 1, 1), 1)
        >>> layout.members("tensor", 3), layout.members("shard", 3)
        ((2, 3), (1, 3))
        >>> str(layout)
        'replicate=1,shard=2,tensor=2'
    """

    replicate: int = attrs.field(default=1, validator=_size)
    shard: int = attrs.field(default=1, validator=_size)
    tensor: int = attrs.field(default=1, validator=_size)

    def __str__(self) -> str:
        return f"replicate={self.replicate},shard={self.shard},tensor={self.tensor}"

    @property
    def shape(self) -> tuple[int, int, int]:
        """The sizes in :data:`DIMENSIONS` order: the DeviceMesh's shape."""
        return (self.replicate, self.shard, self.tensor)

    @property
    def world_size(self) -> int:
        """Ranks the layout spans: the product of the sizes."""
        return self.replicate * self.shard * self.tensor

    @property
    def data_size(self) -> int:
        """Data-parallel ranks (``replicate * shard``): how many ways each batch of the epoch is dealt."""
        return self.replicate * self.shard

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(replicate, shard, tensor)`` coordinates of ``rank``.

        Raises:
            ArgumentValueError: ``rank`` is not in ``[0, world_size)``.
        """
        self._check_rank(rank)
        t = rank % self.tensor
        s = (rank // self.tensor) % self.shard
        return (rank // (self.tensor * self.shard), s, t)

    def rank_of(self, coordinates: tuple[int, int, int]) -> int:
        """The rank at ``coordinates``: the inverse of :meth:`coordinates`.

        Raises:
            ArgumentValueError: A coordinate outside its dimension.
        """
        for name, value, size in zip(DIMENSIONS, coordinates, self.shape, strict=True):
            if not 0 <= value < size:
                msg = f"{name} coordinate must be in [0, {size}), got {value!r}"
                raise ArgumentValueError(msg)
        r, s, t = coordinates
        return (r * self.shard + s) * self.tensor + t

    def data_rank(self, rank: int) -> int:
        """The data-parallel rank of ``rank`` (in ``[0, data_size)``): which share of the data it reads.

        Raises:
            ArgumentValueError: ``rank`` is not in ``[0, world_size)``.
        """
        self._check_rank(rank)
        return rank // self.tensor

    def members(self, dimension: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group along ``dimension``, ascending.

        ``dimension`` is one of :data:`DIMENSIONS`, or ``"data"`` for the
        data-parallel group (replicate and shard together): the ranks that
        share ``rank``'s tensor coordinate.

        Raises:
            ArgumentValueError: An unknown dimension, or a rank outside the layout.
        """
        here = self.coordinates(rank)
        if dimension == "data":
            return tuple(
                self.rank_of((r, s, here[2])) for r in range(self.replicate) for s in range(self.shard)
            )
        if dimension not in DIMENSIONS:
            msg = f"dimension must be one of {[*DIMENSIONS, 'data']}, got {dimension!r}"
            raise ArgumentValueError(msg)
        axis = DIMENSIONS.index(dimension)
        out = []
        for value in range(self.shape[axis]):
            point = list(here)
            point[axis] = value
            out.append(self.rank_of((point[0], point[1], point[2])))
        return tuple(out)

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
        if not 0 <= rank < self.world_size:
            msg = f"rank must be in [0, {self.world_size}) for layout {self}, got {rank!r}"
            raise ArgumentValueError(msg)


_ITEM = re.compile(r"\s*(replicate|shard|tensor)\s*=\s*([0-9]{1,6})\s*")


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
    """
    sizes: dict[str, int] = {}
    for item in text.split(","):
        match = _ITEM.fullmatch(item)
        if match is None or match.group(1) in sizes:
            msg = (
                f"a layout is written 'replicate=R,shard=S,tensor=T' (sizes >= 1, each name at most "
                f"once, missing ones are 1), got {text!r}"
            )
            raise ArgumentValueError(msg)
        sizes[match.group(1)] = int(match.group(2))
    return Layout(**sizes)


def default_layout(strategy: str, world_size: int) -> Layout:
    """The layout a strategy means without one: DDP replicates over every rank, FSDP shards over them.

    Example:
        >>> default_layout("ddp", 4), default_layout("fsdp", 4)
        (Layout(replicate=4, shard=1, tensor=1), Layout(replicate=1, shard=4, tensor=1))
    """
    return Layout(shard=world_size) if strategy == "fsdp" else Layout(replicate=world_size)


def layout_problem(layout: Layout, world_size: int, strategy: str) -> str:
    """What makes ``layout`` unusable for a job of ``world_size`` under ``strategy``; empty if nothing.

    Example:
        >>> layout_problem(Layout(shard=2, tensor=2), 4, "fsdp")
        ''
        >>> layout_problem(Layout(shard=2), 4, "fsdp")[:42]
        'layout replicate=1,shard=2,tensor=1 spans '
    """
    if layout.world_size != world_size:
        return (
            f"layout {layout} spans {layout.world_size} ranks (replicate x shard x tensor), but the "
            f"job has {world_size}; choose sizes whose product is the world size"
        )
    if strategy == "deepspeed" and layout.replicate != world_size:
        return (
            f"layout {layout} asks for shards or tensor parallelism, but strategy 'deepspeed' "
            "partitions over every rank itself (ZeRO); drop the layout, or use strategy='fsdp'"
        )
    if strategy == "ddp" and layout.shard > 1:
        return (
            f"layout {layout} shards parameters over {layout.shard} ranks, which strategy 'ddp' "
            "never does; use strategy='fsdp' (or shard=1)"
        )
    if strategy == "ddp" and layout.tensor > 1 and layout.replicate > 1:
        return (
            f"layout {layout} replicates tensor-parallel weights, which faccel does with FSDP2 "
            "(HSDP with shard=1), not DDP; use strategy='fsdp'"
        )
    return ""


def strategy_for(layout: Layout) -> str:
    """The strategy a layout asks for when none is given: FSDP2 for shards and tensor parallelism.

    Example:
        >>> strategy_for(Layout(replicate=4)), strategy_for(Layout(tensor=4))
        ('ddp', 'fsdp')
    """
    return "fsdp" if layout.shard > 1 or layout.tensor > 1 else "ddp"
