"""The arithmetic of a memory plan: one rank's bytes of each tensor under a layout, pure.

:func:`rank_bytes` computes one rank's share of one tensor from its shape,
dtype and the layout, with FSDP2's rule (dim 0 cut into ``ceil(rows / shard)``
pieces, rank ``s`` taking piece ``s``) after tensor parallelism's split of the
dim its plan names; :func:`layout_plan` adds them up into one rank's
parameters, gradients, optimizer state and what a step holds in flight.
Nothing here builds a model or reads a tensor (``faccel._report._memory_build``
does; ``faccel._report._memory_plan`` puts the two together).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from faccel._dist._layout import Layout, strategy_for
from faccel.errors import ArgumentValueError

__all__ = [
    "OPTIMIZER_STATES",
    "LayoutPlan",
    "ParamSpec",
    "in_flight_microbatches",
    "layout_plan",
    "numel",
    "rank_bytes",
    "shard_rows",
    "stage_cuts",
]

#: Optimizer -> tensors of state per parameter, each the parameter's shape and dtype (as torch's own).
OPTIMIZER_STATES: Mapping[str, int] = {"adamw": 2, "adam": 2, "sgd": 1, "none": 0}


@attrs.frozen
class ParamSpec:
    """One parameter (or buffer) as the plan sees it: its shape, element size and how it is split.

    Attributes:
        name: Its name in ``named_parameters()``.
        shape: The whole tensor's shape.
        itemsize: Bytes per element.
        tensor_dim: The dim tensor parallelism splits (None: replicated over the tensor ranks).
        trainable: Whether it has gradients and optimizer state (``requires_grad``).
        unit: The FSDP2 unit it belongs to (the module path ``fully_shard`` is applied to; ``""``: the root).
        stage: The pipeline coordinate (``layout.coordinate("pipeline", rank)``) of the
            ranks that hold it: its stage's place (None: every rank, as without a pipeline).
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    tensor_dim: int | None = None
    trainable: bool = True
    unit: str = ""
    stage: int | None = None

    @property
    def nbytes(self) -> int:
        """The whole tensor's bytes."""
        return numel(self.shape) * self.itemsize


def numel(shape: tuple[int, ...]) -> int:
    out = 1
    for size in shape:
        out *= size
    return out


def shard_rows(rows: int, parts: int, index: int) -> int:
    """Rows of ``rows`` that piece ``index`` of ``parts`` holds: ``torch.chunk``'s rule, as FSDP2 cuts dim 0.

    Example:
        >>> [shard_rows(10, 4, i) for i in range(4)], [shard_rows(2, 4, i) for i in range(4)]
        ([3, 3, 3, 1], [1, 1, 0, 0])
    """
    chunk = -(-rows // parts)
    return max(0, min(chunk, rows - index * chunk))


def rank_bytes(spec: ParamSpec, layout: Layout, rank: int) -> int:
    """Bytes of ``spec`` that ``rank`` holds under ``layout``: its tensor-parallel piece, then its FSDP2 rows.

    Read by dimension name: a spec placed on a pipeline coordinate (``spec.stage``)
    is held by those ranks only; FSDP2 cuts dim 0 over the shard ranks
    (shard x context together when ``context > 1``, as ``fully_shard`` then
    shards over both).

    Example:
        >>> spec = ParamSpec("w", (10, 4), 4, tensor_dim=1)
        >>> [rank_bytes(spec, Layout(shard=4), r) for r in range(4)]
        [48, 48, 48, 16]
        >>> [rank_bytes(spec, Layout(shard=2, tensor=2), r) for r in range(4)]
        [40, 40, 40, 40]
        >>> staged = ParamSpec("w", (10, 4), 4, stage=1)
        >>> [rank_bytes(staged, Layout(pipeline=2, shard=2), r) for r in range(4)]
        [0, 0, 80, 80]
    """
    if spec.stage is not None and layout.coordinate("pipeline", rank) != spec.stage:
        return 0
    shape = list(spec.shape)
    if layout.tensor > 1 and spec.tensor_dim is not None and shape:
        tensor = layout.coordinate("tensor", rank)
        shape[spec.tensor_dim] = shard_rows(shape[spec.tensor_dim], layout.tensor, tensor)
    shards = layout.shard * layout.context
    if shards > 1 and shape:
        piece = layout.coordinate("shard", rank) * layout.context + layout.coordinate("context", rank)
        shape[0] = shard_rows(shape[0], shards, piece)
    return numel(tuple(shape)) * spec.itemsize


@attrs.frozen
class LayoutPlan:
    """What one rank holds under one layout, in bytes: the largest rank's figures.

    Attributes:
        layout: The rank grid.
        strategy: ``"ddp"`` (whole model per rank) or ``"fsdp"`` (FSDP2, HSDP, tensor parallelism).
        parameters: This rank's parameter bytes (its shards).
        gradients: Its gradients (trainable parameters' shards).
        optimizer: Its optimizer state.
        buffers: Buffers (every rank holds them whole).
        in_flight: What a step holds besides: under FSDP2 the largest unit's whole
            parameters and their whole gradients (gathered for its forward and
            backward, before the reduce-scatter); under DDP its gradient buckets (a
            copy of the gradients; none in one process).
        activations: Activations one forward saves for backward (None: not measured).
        note: What the figures assume.
    """

    layout: Layout
    strategy: str
    parameters: int
    gradients: int
    optimizer: int
    buffers: int
    in_flight: int
    activations: int | None = None
    note: str = ""

    @property
    def states(self) -> int:
        """Parameters, gradients and optimizer state: what stays between steps (with buffers)."""
        return self.parameters + self.gradients + self.optimizer + self.buffers

    @property
    def peak(self) -> int:
        """A step's high-water mark when gradients are freed between steps (``zero_grad()``'s default).

        At the end of a forward a rank holds its parameters, buffers, optimizer
        state, what is in flight and the activations; the backward then frees
        activations as it makes gradients. So the peak is the states and what is
        in flight, with the larger of the activations and the gradients.
        """
        return (
            self.parameters + self.buffers + self.optimizer + self.in_flight
            + max(self.activations or 0, self.gradients)
        )  # fmt: skip

    @property
    def total(self) -> int:
        """Everything added up: states, what is in flight and activations (a bound on :attr:`peak`)."""
        return self.states + self.in_flight + (self.activations or 0)


def stage_cuts(specs: Sequence[ParamSpec], stages: int, split: Sequence[str] | None = None) -> list[int]:
    """The stage (in ``[0, stages)``) of each spec, in order: cut where ``split`` names, else by bytes.

    With ``split`` (module names where a stage begins, as ``prepare(split=...)``
    takes them) a new stage begins at the first parameter under each name;
    without it the parameters, in registration order, are cut into ``stages``
    contiguous runs of about equal bytes (a pipeline's usual balance).

    Example:
        >>> specs = [ParamSpec(f"layers.{i}.w", (4,), 4) for i in range(4)]
        >>> stage_cuts(specs, 2), stage_cuts(specs, 2, ["layers.3"])
        ([0, 0, 1, 1], [0, 0, 0, 1])
    """
    if split:
        out, stage, starts = [], 0, list(split)
        for spec in specs:
            if starts and spec.name.startswith(starts[0] + "."):
                starts.pop(0)
                stage += 1
            out.append(min(stage, stages - 1))
        return out
    total = sum(spec.nbytes for spec in specs) or 1
    out, seen = [], 0
    for spec in specs:
        out.append(min(stages - 1, seen * stages // total))
        seen += spec.nbytes
    return out


def in_flight_microbatches(kind: str, pipeline: int, microbatches: int, per_rank: int) -> int:
    """Micro-batches whose activations the busiest rank (pipeline rank 0) holds at once, per stage it holds.

    GPipe runs every forward before any backward (all ``microbatches``);
    1F1B holds at most ``pipeline`` (its warm-up); the interleaved and
    zero-bubble schedules warm up ``(per_rank - 1) * pipeline + 2 * (pipeline
    - 1)`` forwards over their ``per_rank`` stages before the first backward
    (torch's schedules), spread over those stages.

    Example:
        >>> kinds = (("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2))
        >>> [in_flight_microbatches(kind, 4, 8, per_rank) for kind, per_rank in kinds]
        [8, 4, 6]
    """
    if kind == "gpipe":
        return microbatches
    if per_rank == 1:
        return min(microbatches, pipeline)
    warm_up = (per_rank - 1) * pipeline + 2 * (pipeline - 1) + 1
    return min(microbatches, -(-warm_up // per_rank))


def layout_plan(
    specs: Iterable[ParamSpec],
    layout: Layout,
    *,
    optimizer: str = "adamw",
    buffers: int = 0,
    activations: int | None = None,
    split: Sequence[str] | None = None,
    schedule: Any = None,
) -> LayoutPlan:
    """The :class:`LayoutPlan` of parameters ``specs`` under ``layout``: pure arithmetic.

    Each figure is the largest over the ranks (FSDP2's rule gives rank 0 the most rows).

    Raises:
        ArgumentValueError: An optimizer not in :data:`OPTIMIZER_STATES`.

    Example:
        >>> specs = [ParamSpec("w", (1000, 10), 4), ParamSpec("b", (10,), 4)]
        >>> plan = layout_plan(specs, Layout(shard=4))
        >>> plan.parameters, plan.gradients, plan.optimizer
        (10012, 10012, 20024)
        >>> layout_plan(specs, Layout(replicate=4)).parameters
        40040
    """
    if optimizer not in OPTIMIZER_STATES:
        msg = f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}"
        raise ArgumentValueError(msg)
    specs = list(specs)
    states = OPTIMIZER_STATES[optimizer]
    strategy = strategy_for(layout)
    notes = []
    if layout.pipeline > 1:
        from faccel._loop._strategies._pipeline._stages import Schedule, stage_indices

        schedule = schedule if schedule is not None else Schedule()
        per, count = schedule.per_rank, schedule.micro(pipeline=layout.pipeline)
        where = {s: r for r in range(layout.pipeline) for s in stage_indices(schedule, r, layout.pipeline)}
        cuts = stage_cuts(specs, layout.pipeline * per, split)
        specs = [attrs.evolve(spec, stage=where[cut]) for spec, cut in zip(specs, cuts, strict=True)]
        if activations is not None:
            # One stage's share of a forward's activations, per micro-batch, times those held at once.
            held = in_flight_microbatches(schedule.kind, layout.pipeline, count, per)
            activations = -(-activations * held * per // (layout.pipeline * per * count))
        notes.append(
            f"{schedule.kind}, {count} micro-batches; stages cut "
            + ("at " + ",".join(split) if split else "by bytes")
            + "; activations: an even share per stage"
        )
    best: tuple[int, int] = (0, 0)
    # Ranks that differ only in their replicate coordinate hold the same bytes.
    for rank in range(layout.world_size):
        if layout.coordinate("replicate", rank) == 0:
            params = sum(rank_bytes(spec, layout, rank) for spec in specs)
            trained = sum(rank_bytes(spec, layout, rank) for spec in specs if spec.trainable)
            best = max(best, (params, trained))
    params, trained = best
    if strategy == "ddp":
        in_flight = trained if layout.world_size > 1 else 0  # one process has no DDP wrapper
    else:
        whole: dict[str, list[int]] = {}
        for spec in specs:
            local = rank_bytes(spec, Layout(tensor=layout.tensor), 0)
            sums = whole.setdefault(spec.unit, [0, 0])
            sums[0] += local
            sums[1] += local if spec.trainable else 0
        in_flight = max((p + g for p, g in whole.values()), default=0)
    if layout.tensor > 1 and not any(spec.tensor_dim is not None for spec in specs):
        notes.append("no tensor-parallel plan: every parameter replicated over the tensor ranks")
    return LayoutPlan(
        layout=layout,
        strategy=strategy,
        parameters=params,
        gradients=trained,
        optimizer=states * trained,
        buffers=buffers,
        in_flight=in_flight,
        activations=activations,
        note="; ".join(notes),
    )
