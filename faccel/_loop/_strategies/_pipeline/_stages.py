"""Pipeline stages: a user's model cut by ``torch.distributed.pipelining``, and one step for any layout.

A layout with ``pipeline = p > 1`` gives each block of ranks along the
outermost dimension one stage of the model (or several: interleaved and
zero-bubble schedules give each rank ``v`` stages). ``prepare(dist, model,
split=..., schedule=...)`` returns a :class:`PipelinedModel`: the stages of
this rank, each a submodule of the user's model (by module names, through
torch's tracer ``pipeline(..., split_spec=...)``, which keeps the original
parameter names and objects; or built by the user's function
``build(stage, stages)``), each wrapped by the other dimensions as a whole
model would be (tensor parallelism from the plan, then FSDP2/HSDP over the
data-parallel ranks of its block), each a torch ``PipelineStage`` over the
mesh's ``"pipeline"`` group, driven by one of torch's schedules.

A schedule owns forward and backward together, so the seed loop's ``loss =
f(model(x)); backward(dist, loss)`` cannot drive it: :func:`forward_backward`
is that step for every layout. For a plain (or DDP, FSDP2...) model it is
exactly those two lines; for a :class:`PipelinedModel` it is the schedule's
step over the micro-batches, with each micro-batch's loss scaled as
``backward`` would scale the whole batch's (accumulation, ``items=``), and the
loss comes back on every rank. The stages are built on the first call,
because torch's tracer and stages need a micro-batch's shapes, or at
``prepare(..., example=batch)``, so that ``restore`` can fill them before
training (checkpoints of stages: ``faccel._checkpoint._strategies._pipeline``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import torch
from torch import nn

from faccel._dist._region import region
from faccel._dist._state import DistState
from faccel._loop._micro_step import MicroStep
from faccel._marks import OTHER_STAGE, REPLACED_BY
from faccel._torch_compat import incompatible_keys
from faccel.errors import ArgumentValueError, PrecisionError, PrepareError, UsageError

__all__ = ["SCHEDULES", "PipelinedModel", "Schedule", "pipeline_step", "pipelined", "stage_indices"]

# kind -> (torch's schedule class in torch.distributed.pipelining, how stages sit on ranks, stages per rank)
# "loop": rank r holds stages r, r + p, r + 2p ...; "v": rank r holds r and 2p - 1 - r (a V).
# Schedule.kind: each of SCHEDULES' keys (tests/test_pipeline.py holds them equal).
ScheduleKind = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]
SCHEDULES: dict[str, tuple[str, str, int]] = {
    "gpipe": ("ScheduleGPipe", "loop", 1),
    "1f1b": ("Schedule1F1B", "loop", 1),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "loop", 2),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", "loop", 2),
    "zbv": ("ScheduleZBVZeroBubble", "v", 2),
}


def _kind(_: object, attribute: object, value: object) -> None:
    if value not in SCHEDULES:
        msg = f"Schedule.kind must be one of {sorted(SCHEDULES)}, got {value!r}"
        raise ArgumentValueError(msg)


def _positive_or_none(_: object, attribute: Any, value: object) -> None:
    if value is not None and (type(value) is not int or value < 1):
        msg = f"Schedule.{attribute.name} must be an int >= 1 or None, got {value!r}"
        raise ArgumentValueError(msg)


@attrs.frozen(kw_only=True)
class Schedule:
    """A pipeline schedule as a value: which of torch's schedules, over how many micro-batches.

    Attributes:
        kind: ``"gpipe"`` (all forwards, then all backwards), ``"1f1b"`` (one
            forward, one backward), ``"interleaved_1f1b"`` (several stages per
            rank, looped), ``"zero_bubble"`` (interleaved, the weight gradients
            deferred into the bubble) or ``"zbv"`` (zero bubble, two stages per
            rank in a V): torch's ``ScheduleGPipe``, ``Schedule1F1B``,
            ``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``,
            ``ScheduleZBVZeroBubble``.
        microbatches: Micro-batches each batch is split into (along dim 0);
            None: one per stage of the whole pipeline.
        stages_per_rank: Stages each rank holds; None: the kind's own (1 for
            GPipe and 1F1B, 2 for the others).

    Example:
        >>> s = Schedule(kind="interleaved_1f1b", microbatches=8)
        >>> s.per_rank, s.micro(pipeline=2)
        (2, 8)
        >>> Schedule().micro(pipeline=4)
        4
    """

    kind: ScheduleKind = attrs.field(default="1f1b", validator=_kind)
    microbatches: int | None = attrs.field(default=None, validator=_positive_or_none)
    stages_per_rank: int | None = attrs.field(default=None, validator=_positive_or_none)

    @property
    def per_rank(self) -> int:
        """Stages each rank holds."""
        return self.stages_per_rank if self.stages_per_rank is not None else SCHEDULES[self.kind][2]

    def micro(self, *, pipeline: int) -> int:
        """Micro-batches per batch for a pipeline of ``pipeline`` ranks."""
        return self.microbatches if self.microbatches is not None else pipeline * self.per_rank


def stage_indices(schedule: Schedule, pipeline_rank: int, pipeline: int) -> tuple[int, ...]:
    """The stages (of ``pipeline * schedule.per_rank``) that pipeline rank ``pipeline_rank`` holds.

    Example:
        >>> [stage_indices(Schedule(kind="interleaved_1f1b"), r, 2) for r in range(2)]
        [(0, 2), (1, 3)]
        >>> [stage_indices(Schedule(kind="zbv"), r, 2) for r in range(2)]
        [(0, 3), (1, 2)]
    """
    per, style = schedule.per_rank, SCHEDULES[schedule.kind][1]
    if style == "v":
        if per != 2:
            msg = f"schedule {schedule.kind!r} holds 2 stages per rank (a V), got stages_per_rank={per}"
            raise ArgumentValueError(msg)
        return (pipeline_rank, 2 * pipeline - 1 - pipeline_rank)
    if per > 1 and schedule.kind in ("gpipe", "1f1b"):
        msg = (
            f"schedule {schedule.kind!r} drives one stage per rank, got stages_per_rank={per}; "
            "use 'interleaved_1f1b' or 'zero_bubble' for several"
        )
        raise ArgumentValueError(msg)
    return tuple(pipeline_rank + k * pipeline for k in range(per))


Split = Sequence[str] | Callable[[int, int], nn.Module]


class PipelinedModel(nn.Module):
    """This rank's pipeline stages of a model, and the schedule that drives them (from ``prepare``).

    ``stages`` holds this rank's stage modules (each wrapped by the other
    dimensions), filled by the first :func:`forward_backward`; their
    parameters keep the original model's names. Train it with
    :func:`forward_backward`; calling it directly is refused (a schedule runs
    forward and backward together).

    Example:
        >>> import torch, faccel
        >>> dist = faccel.DistState.simulated(world_size=2, layout=faccel.Layout(pipeline=2))
        >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
        >>> model = faccel.prepare(dist, net, split=("1",))
        >>> type(model).__name__, model.schedule.kind, model.built
        ('PipelinedModel', '1f1b', False)
    """

    # Set with object.__setattr__ (nn.Module's own would register modules and check types).
    schedule: Schedule
    stage_ids: tuple[int, ...]
    _dist: DistState
    _source: nn.Module
    _split: Split
    _options: Any
    _driver: Any
    _route: Any  # a _LossRoute once built
    _warm: bool  # the schedule ran a step (its first one also infers the stages' metadata)
    shapes: tuple[tuple[int, ...] | None, ...]

    def __init__(
        self, dist: DistState, source: nn.Module, split: Split, schedule: Schedule, options: Any
    ) -> None:
        super().__init__()
        self.stages = nn.ModuleList()
        # Not submodules: the source's other stages must not count as this rank's parameters.
        object.__setattr__(self, "_dist", dist)
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_split", split)
        object.__setattr__(self, "_options", options)
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "_driver", None)
        object.__setattr__(self, "_route", None)
        object.__setattr__(self, "_warm", False)
        object.__setattr__(self, "stage_ids", ())
        object.__setattr__(self, "shapes", ())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        msg = (
            "a pipelined model runs forward and backward together, in its schedule: call "
            "loss = faccel.forward_backward(dist, model, loss_fn, inputs, targets) instead of "
            "model(inputs) and faccel.backward (the same call works at every layout)"
        )
        raise UsageError(msg)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """This rank's stages' state, by the model's own names (a stage holds some of the names only).

        Raises:
            UsageError: The stages are not built yet (``prepare(..., example=batch)`` builds them).
        """
        from faccel._loop._model import peel

        if not self.built:
            raise UsageError(_NOT_BUILT)
        out: dict[str, Any] = {}
        for stage in self.stages:
            out.update(peel(stage).state_dict(*args, **kwargs))
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load this rank's stages' names from ``state_dict`` (other stages' names are not this rank's).

        Raises:
            UsageError: The stages are not built yet.
        """
        from faccel._loop._model import peel

        if not self.built:
            raise UsageError(_NOT_BUILT)
        missing: list[str] = []
        for stage in self.stages:
            module = peel(stage)
            own = {k: v for k, v in state_dict.items() if k in module.state_dict()}
            missing += module.load_state_dict(own, strict=strict, assign=assign).missing_keys
        return incompatible_keys(missing, [])  # what Module.load_state_dict returns

    @property
    def source(self) -> nn.Module:
        """The whole model given to ``prepare``: its config, its names (its other stages' parameters
        are never trained here)."""
        return self._source

    @property
    def _peers(self) -> tuple[int, ...]:
        """The global ranks of this rank's pipeline group but this one: whom its schedule waits on."""
        dist = self._dist
        if not dist.distributed:
            return ()
        return tuple(r for r in dist.parallel.members("pipeline", dist.rank) if r != dist.rank)

    @property
    def built(self) -> bool:
        """Whether the stages exist (after the first :func:`forward_backward`)."""
        return self._driver is not None

    def holds_last_stage(self) -> bool:
        """Whether this rank holds the pipeline's last stage (where the loss is computed)."""
        total = self._dist.parallel.pipeline * self.schedule.per_rank
        return total - 1 in self.stage_ids


def pipelined(dist: DistState, model: nn.Module, options: Any) -> PipelinedModel:
    """``prepare``'s handler for a model under a layout with pipeline stages: a :class:`PipelinedModel`.

    Raises:
        PrepareError: No ``split``, a ``split`` of the wrong kind, or a
            strategy other than FSDP2 (the stages' data-parallel wrapping).
    """
    split = options.split
    if split is None:
        msg = (
            f"layout {dist.parallel} cuts the model into {dist.parallel.pipeline} pipeline stages, but "
            "prepare got no split=: name the modules where a stage begins, split=('layers.4',), or give a "
            "function build(stage, stages) -> nn.Module"
        )
        raise PrepareError(msg)
    if not callable(split) and not (
        isinstance(split, tuple) and split and all(isinstance(name, str) for name in split)
    ):
        msg = (
            "split must be a non-empty tuple of module names or a function build(stage, stages), "
            f"got {split!r:.80}"
        )
        raise PrepareError(msg)
    if isinstance(split, tuple):
        known = {name for name, _ in model.named_modules() if name}  # "" is the model itself
        unknown = [name for name in split if name not in known]
        if unknown:
            msg = (
                f"split names {unknown}, which are not submodules of the {type(model).__name__}: name "
                f"the modules where a stage begins, as model.named_modules() names them (e.g. {_some(known)})"
            )
            raise PrepareError(msg)
        if len(set(split)) != len(split):
            msg = f"split names a module twice, {split!r}: each name is where one stage begins"
            raise PrepareError(msg)
    if dist.strategy != "fsdp":
        msg = (
            f"pipeline stages are wrapped by FSDP2 over their data-parallel ranks; strategy "
            f"{dist.strategy!r} is not supported with pipeline={dist.parallel.pipeline}: use strategy='fsdp'"
        )
        raise PrepareError(msg)
    if dist.parallel.expert > 1 or options.experts is not None or options.expert_capacity is not None:
        options = _stage_experts(dist, model, options)
    schedule = options.schedule if options.schedule is not None else Schedule()
    if not isinstance(schedule, Schedule):
        msg = f"schedule must be a faccel.Schedule, got {schedule!r}"
        raise PrepareError(msg)
    stage_indices(schedule, 0, dist.parallel.pipeline)  # a schedule that cannot place its stages
    piped = PipelinedModel(dist, model, split, schedule, options)
    if options.example is not None:  # built now: a restore or load_model can fill the stages before training
        args = options.example if isinstance(options.example, tuple) else (options.example,)
        _check_rows(args, None, schedule.micro(pipeline=dist.parallel.pipeline))
        with region(dist, "prepare(..., example=) building the pipeline stages", piped._peers):
            _build(piped, args)
        shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in args)
        object.__setattr__(piped, "shapes", shapes)
    return piped


def _stage_experts(dist: DistState, model: nn.Module, options: Any) -> Any:
    """``options`` naming the whole model's experts modules, found or checked now, before any stage is
    built: each stage splits those it holds (``_build``), over the ranks of its expert group."""
    from faccel._loop._strategies._experts._find import find_experts

    if not callable(options.split):
        msg = (
            f"layout {dist.parallel} splits experts inside pipeline stages, whose dispatch replaces each "
            "experts module's forward; a stage cut by module names (torch's tracer) never calls it: give "
            "split= a function build(stage, stages) that builds the stage from the model's own modules"
        )
        raise PrepareError(msg)
    return attrs.evolve(options, experts=tuple(find_experts(model, options.experts)))


def _some(names: set[str]) -> str:
    """A few module names, for a message."""
    return ", ".join(repr(name) for name in sorted(names, key=lambda n: (n.count("."), n))[:3])


_NOT_BUILT = (
    "the PipelinedModel's stages are not built yet (they are built at the first forward_backward, "
    "from a batch's shapes), so it holds no state to checkpoint, restore or load into: pass "
    "prepare(..., example=batch) (this rank's batch, as forward_backward gets it) to build them at prepare"
)


def _scaled_loss(
    output: Any,
    target: Any,
    *,
    fn: Callable[..., torch.Tensor],
    factor: float,
    scaler: Any,
    sink: _StepLoss | None = None,
) -> torch.Tensor:
    """One micro-batch's loss scaled as ``backward`` scales a whole batch's (torch's schedules call it).

    A factor of 1 multiplies nothing (the same bits, one autograd node less). ``sink`` collects the
    step's losses (:class:`_StepLoss`).

    Example:
        >>> mse = torch.nn.functional.mse_loss
        >>> out, target = torch.ones(2, requires_grad=True), torch.zeros(2)
        >>> _scaled_loss(out, target, fn=mse, factor=0.25, scaler=None)
        tensor(0.2500, grad_fn=<MulBackward0>)
        >>> _scaled_loss(out, target, fn=mse, factor=1.0, scaler=None)
        tensor(1., grad_fn=<MseLossBackward0>)
    """
    loss = fn(output, target)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else None
        what = type(loss).__name__ if shape is None else f"a tensor of shape {shape}"
        msg = (
            f"the loss function given to forward_backward returned {what} on the last pipeline stage; it "
            "must return the micro-batch's loss as a scalar tensor: reduce it with .mean() (or .sum() "
            "with items=)"
        )
        raise UsageError(msg)
    if sink is not None:
        sink.add(loss)
    if factor != 1.0:
        loss = loss * factor
    return scaler.scale(loss) if scaler is not None else loss


# The tag of the loss's messages from the last stage to the other pipeline ranks over gloo, which
# matches a message to a receive by sender and tag: torch's schedules send with tag 0, so none of
# theirs can take this receive, and it can be posted before the schedule runs.
_LOSS_TAG = 0x10557A6


@attrs.frozen
class _LossRoute:
    """How the loss goes from the rank holding the last stage to the rest of its pipeline group.

    Made once, when the stages are built. ``early``: the backend matches messages by tag (gloo),
    so the other ranks post their receive before the schedule and the last stage's send finds it
    waiting (one message, no round trip at the end of the step); else a broadcast after the
    schedule (NCCL, which ignores tags, queues it on the stream without waiting for it).

    Example:
        >>> route = _LossRoute(group=None, rank=0, holder=1, size=2, early=True)
        >>> route.holds_loss, route.peers
        (False, (0,))
    """

    group: Any
    rank: int  # this rank's pipeline coordinate (its rank in ``group``)
    holder: int  # the pipeline coordinate of the rank holding the last stage
    size: int
    early: bool

    @property
    def holds_loss(self) -> bool:
        """Whether this rank holds the last stage (where the loss is computed)."""
        return self.rank == self.holder

    @property
    def peers(self) -> tuple[int, ...]:
        """The pipeline ranks the loss is sent to."""
        return tuple(r for r in range(self.size) if r != self.holder)


class _StepLoss:
    """The last stage's micro-batch losses of one step, summed as they come, and the batch's loss.

    torch's schedule calls :func:`_scaled_loss` once per micro-batch, in order. Each loss is
    added unscaled as it is made, so with the last micro-batch's the batch's loss is one division
    away, before the schedule's remaining backwards: it is made then and, over gloo
    (``route.early``), sent to the other pipeline ranks, whose receive waits since before the
    schedule, so neither side waits for it when the schedule returns. A schedule's first step
    also calls the loss function for its metadata inference, before the micro-batches: that step
    (``deferred``) keeps every loss and sums the last ``count`` after the schedule, in the same
    order, so every step's loss is made the same way.

    Example:
        >>> route = _LossRoute(group=None, rank=0, holder=0, size=1, early=False)
        >>> sink = _StepLoss(route, count=2, mean=True, deferred=False)
        >>> sink.add(torch.tensor(1.0)); sink.add(torch.tensor(3.0))
        >>> sink.finish()  # the mean of the micro-batches' losses
        tensor(2.)
        >>> first = _StepLoss(route, count=2, mean=True, deferred=True)
        >>> for loss in (9.0, 1.0, 3.0):  # the first: torch's metadata inference
        ...     first.add(torch.tensor(loss))
        >>> first.finish()
        tensor(2.)
    """

    __slots__ = ("added", "count", "deferred", "kept", "mean", "route", "sends", "sum", "total")

    def __init__(self, route: _LossRoute, *, count: int, mean: bool, deferred: bool) -> None:
        self.route, self.count, self.mean, self.deferred = route, count, mean, deferred
        self.added = 0
        self.kept: list[torch.Tensor] = []
        self.sum: torch.Tensor | None = None
        self.total: torch.Tensor | None = None
        self.sends: list[Any] = []

    def add(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss, unscaled; with the last, the batch's loss is made (and sent, over gloo)."""
        loss = loss.detach().float()
        if self.deferred:
            self.kept.append(loss)
            return
        self._sum(loss)
        if self.added == self.count:
            self._make()

    def _sum(self, loss: torch.Tensor) -> None:
        self.sum = loss if self.sum is None else self.sum + loss
        self.added += 1

    def _make(self) -> torch.Tensor:
        if self.deferred:  # the schedule's micro-batches are the last ``count`` losses it made
            for loss in self.kept[-self.count :]:
                self._sum(loss)
        if self.sum is None or self.added != self.count:
            msg = f"the pipeline schedule made {self.added} losses on the last stage, not {self.count}"
            raise RuntimeError(msg)
        # as the plain call returns it: the mean of the micro-batch means, or (items=) the sum
        total = self.total = self.sum / self.count if self.mean else self.sum
        if self.route.early:
            import torch.distributed as tdist

            group = self.route.group
            for peer in self.route.peers:
                self.sends.append(tdist.isend(total, group=group, group_dst=peer, tag=_LOSS_TAG))
        return total

    def finish(self) -> torch.Tensor:
        """The batch's loss, once the schedule returned; its sends done."""
        total = self.total if self.total is not None else self._make()
        for work in self.sends:
            if work is not None:  # None only on a rank outside the group
                work.wait()
        return total


def _micro_inputs(inputs: tuple[Any, ...], count: int) -> tuple[Any, ...]:
    return tuple(x.tensor_split(count)[0] if isinstance(x, torch.Tensor) else x for x in inputs)


def _wrap_stage(dist: DistState, module: nn.Module, options: Any) -> nn.Module:
    """One stage wrapped as a whole model would be: the TP plan, then FSDP2 over the block's data ranks."""
    from faccel._dist._mesh import data_mesh
    from faccel._loop._model import Autocast
    from faccel._loop._strategies._fsdp import wrap_fsdp
    from faccel._loop._strategies._mesh._tp_plan import apply_plan

    layout = dist.parallel
    if isinstance(module, torch.fx.GraphModule):
        # A traced stage calls aten ops on its parameters (get_attr), not its submodules' forwards,
        # so per-submodule hooks (FSDP2 units, tensor parallelism's) would never run: one unit.
        if layout.tensor > 1:
            msg = (
                "tensor parallelism splits modules by their forward hooks, which a stage cut by module "
                "names (torch's tracer) never calls; give split= a function build(stage, stages) that "
                "builds the stage from the model's own modules"
            )
            raise PrepareError(msg)
        options = attrs.evolve(options, shard_policy=_root_only)
    elif options.shard_policy is None:
        options = attrs.evolve(options, shard_policy=_stage_policy(module))
    if layout.tensor > 1:
        apply_plan(dist, module, options.tp_plan)
    if layout.data_size * layout.context > 1:
        return wrap_fsdp(dist, module, options, mesh=data_mesh(dist))
    if dist.autocast_dtype is not None:
        return Autocast(module, device_type=dist.device.type, dtype=dist.autocast_dtype)
    return module


def _root_only(module: nn.Module) -> bool:
    return False


def _stage_policy(root: nn.Module) -> Callable[[nn.Module], bool]:
    """FSDP2 units of a built stage: each block of its first ModuleList or ModuleDict (a stage keeps the
    model's names, so its blocks often sit in a dict keyed by their global index), else each child."""
    blocks = next((m for m in root.modules() if isinstance(m, nn.ModuleList | nn.ModuleDict)), None)
    if blocks is None:
        units = [m for m in root.children() if not isinstance(m, nn.ModuleList | nn.ModuleDict)]
    else:
        units = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    chosen = {id(m) for m in units}
    return lambda module: id(module) in chosen and any(True for _ in module.parameters())


def _stage_modules(
    model: PipelinedModel, ids: tuple[int, ...], total: int, inputs: tuple[Any, ...]
) -> list[nn.Module]:
    split, source = model._split, model._source
    if callable(split):
        built = [split(i, total) for i in ids]
        for i, module in zip(ids, built, strict=True):
            if not isinstance(module, nn.Module):
                msg = f"the split function returned a {type(module).__name__} for stage {i}, not an nn.Module"
                raise PrepareError(msg)
        return built
    from torch.distributed.pipelining import SplitPoint, pipeline

    device = next(source.parameters()).device
    micro = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    pipe = pipeline(source, mb_args=micro, split_spec={name: SplitPoint.BEGINNING for name in split})
    if pipe.num_stages != total:
        msg = (
            f"split={tuple(split)!r} cuts the model into {pipe.num_stages} stages, but the layout's "
            f"pipeline={model._dist.parallel.pipeline} x {model.schedule.per_rank} stage(s) per rank "
            f"needs {total}; name {total - 1} module(s) where a new stage begins"
        )
        raise PrepareError(msg)
    return [pipe.get_stage_module(i) for i in ids]


def _build(model: PipelinedModel, inputs: tuple[Any, ...]) -> None:
    """Make this rank's stages, their wrappers, torch's PipelineStages and the schedule, once."""
    from torch.distributed import pipelining

    from faccel._dist._mesh import dimension_group
    from faccel._loop._materialize import materialize, prepare_meta
    from faccel._loop._strategies._experts._dispatch import split_experts

    dist, schedule, options = model._dist, model.schedule, model._options
    layout = dist.parallel
    pipeline_rank = layout.coordinate("pipeline", dist.rank)
    ids = stage_indices(schedule, pipeline_rank, layout.pipeline)
    total = layout.pipeline * schedule.per_rank
    count = schedule.micro(pipeline=layout.pipeline)
    modules = _stage_modules(model, ids, total, _micro_inputs(inputs, count))
    source = dict(model._source.named_parameters())
    mine: set[int] = set()
    group = dimension_group(dist, "pipeline")
    sharded = layout.data_size * layout.context > 1 or layout.tensor > 1
    stages = []
    for stage_id, module in zip(ids, modules, strict=True):
        before = dict(module.named_parameters())
        foreign = sorted(set(before) - set(source))
        if foreign:
            tied = _tied_across(model._source, foreign)
            if tied:
                raise PrepareError(tied)
        if foreign:
            msg = (
                f"stage {stage_id}'s parameters {foreign[:3]} are not parameters of the model given to "
                "prepare: a stage keeps the model's names (build it from the model's own modules), so "
                "the optimizer and checkpoints find them"
            )
            raise PrepareError(msg)
        # Only this stage is allocated, from a meta-built one: after its sharding when it is sharded.
        meta = prepare_meta(module, dist.device, options.init, shards_first=sharded)
        if not meta:
            module.to(dist.device)
        if options.experts is not None:  # the stage's experts (checked on the whole model at prepare)
            held = dict(module.named_modules())
            here = attrs.evolve(options, experts=tuple(name for name in options.experts if name in held))
            split_experts(dist, module, here)
        wrapped = _wrap_stage(dist, module, options)
        if meta and sharded:
            materialize(module, dist.device, options.init)
        # The optimizer holds the model's parameters: point each at what this stage trains instead.
        for name, new in module.named_parameters():
            for old in (before[name], source[name]):
                if old is not new:
                    setattr(old, REPLACED_BY, new)
            mine.add(id(source[name]))
        model.stages.append(wrapped)
        stages.append(pipelining.PipelineStage(wrapped, stage_id, total, dist.device, group=group))
    for param in model._source.parameters():
        if id(param) not in mine:
            setattr(param, OTHER_STAGE, True)  # held by another pipeline stage: the optimizer drops it
    kind = getattr(pipelining, SCHEDULES[schedule.kind][0])
    first = stages[0] if len(stages) == 1 and schedule.per_rank == 1 else stages
    # scale_grads=False: _scaled_loss scales each micro-batch's loss as backward() would.
    driver = kind(first, n_microbatches=count, loss_fn=_scaled_loss, scale_grads=False)
    last = total - 1
    holder = next(r for r in range(layout.pipeline) if last in stage_indices(schedule, r, layout.pipeline))
    route = _LossRoute(
        group=group, rank=pipeline_rank, holder=holder, size=layout.pipeline, early=dist.backend == "gloo"
    )
    object.__setattr__(model, "stage_ids", ids)
    object.__setattr__(model, "_route", route)
    object.__setattr__(model, "_driver", driver)


def _tied_across(source: nn.Module, names: list[str]) -> str:
    """Why ``names`` of a traced stage are not the model's: a parameter tied to one of another stage."""
    canonical = {id(p): name for name, p in source.named_parameters()}
    every = dict(source.named_parameters(remove_duplicate=False))
    pairs = [f"{name} is {canonical[id(every[name])]}" for name in names if name in every]
    if not pairs:
        return ""
    return (
        f"the model ties parameters across pipeline stages ({', '.join(pairs[:3])}): a stage holds its "
        "own parameters, so a weight shared by two stages would be trained apart in each; untie them "
        "(a copy per stage), or move the split so that both users of the weight are in one stage"
    )


def _factor(dist: DistState, count: int, micro: MicroStep | None, items: int | None) -> float:
    """What each micro-batch's loss is multiplied by: ``backward``'s scaling, spread over ``count``."""
    if items is not None or (micro is not None and micro.items is not None):
        if micro is None or micro.items is None or items is None:
            msg = (
                "forward_backward(..., items=n) needs the group's item count: iterate "
                "faccel.micro_batches(dist, loader, items=count) and pass micro= and items= together"
            )
            raise UsageError(msg)
        # the loss is a sum over items; FSDP2 averages over the data-parallel ranks: multiply that back
        return (dist.data_world_size if dist.distributed else 1) / max(micro.items, 1)
    group = micro.group_size if micro is not None else 1
    if micro is None and dist.accumulation_steps != 1:
        msg = (
            f"accumulation_steps is {dist.accumulation_steps} but forward_backward() got no micro-step; "
            "iterate faccel.micro_batches(dist, loader) and pass micro="
        )
        raise UsageError(msg)
    return 1.0 / (count * group)


def pipeline_step(
    dist: DistState,
    model: PipelinedModel,
    loss_fn: Callable[..., torch.Tensor],
    args: tuple[Any, ...],
    targets: Any,
    *,
    micro: MicroStep | None = None,
    items: int | None = None,
) -> torch.Tensor:
    """:func:`faccel.forward_backward` of a :class:`PipelinedModel`: the schedule's step over its stages.

    The batch is split into ``schedule.microbatches`` micro-batches along dim 0,
    each runs through the stages, its loss ``loss_fn(output, target)`` is scaled
    as ``backward`` would scale the batch's (the mean over micro-batches, over
    the accumulation group; or, with ``items=``, a sum over the group's items),
    and its backward runs where the schedule puts it. The loss returned is the
    batch's, as the plain call returns it (the mean of the micro-batch means;
    with ``items=``, their sum), sent from the last stage to every rank.

    Raises:
        UsageError: Accumulation without ``micro``, ``items`` without a counted
            micro-step, or a batch of another shape than the first.
        PrecisionError: fp16 (its loss scale would have to agree across stages).
    """
    if dist.precision == "fp16":
        msg = (
            "fp16 under a pipeline needs one loss scale agreed by every stage, which faccel does not do; "
            "use precision='bf16' (no loss scaling), or no pipeline"
        )
        raise PrecisionError(msg)
    count = model.schedule.micro(pipeline=dist.parallel.pipeline)
    _check_rows(args, targets, count)  # on every rank alike, before any message
    shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in args)
    if not model.built:
        with region(dist, "forward_backward() building the pipeline stages", model._peers):
            _build(model, args)
        object.__setattr__(model, "shapes", shapes)
    elif shapes != model.shapes:
        msg = (
            f"a pipeline's stages exchange activations of the shapes of its first batch, {model.shapes}; "
            f"this batch has {shapes}. Give every step the same batch size (drop_last=True in the "
            "DataLoader, or pad the last batch)"
        )
        raise UsageError(msg)
    factor = _factor(dist, count, micro, items)
    route: _LossRoute = model._route
    with region(dist, "forward_backward() in the pipeline schedule", model._peers):
        mean = items is None
        return _step(dist, model, route, args, targets, loss_fn, count=count, factor=factor, mean=mean)


def _step(
    dist: DistState,
    model: PipelinedModel,
    route: _LossRoute,
    args: tuple[Any, ...],
    targets: Any,
    loss_fn: Callable[..., torch.Tensor],
    *,
    count: int,
    factor: float,
    mean: bool,
) -> torch.Tensor:
    """The schedule's step and the loss's way to every rank (inside a collective region)."""
    # The last stage sums its losses as the schedule makes them (its first step also makes one for
    # torch's metadata inference: that step sums after the schedule); the others, over gloo, post
    # their receive of the batch's loss now, so it arrives while the schedule runs (see _StepLoss).
    sink = None
    if route.holds_loss:
        sink = _StepLoss(route, count=count, mean=mean, deferred=not model._warm)
    early = _expect_loss(route, dist.device) if route.early and not route.holds_loss else None
    from faccel._torch_compat import pipelining_metadata_error

    PipeliningMetadataError = pipelining_metadata_error()

    try:
        model._driver.step(
            *(args if 0 in model.stage_ids else ()),
            target=targets if route.holds_loss else None,
            loss_kwargs={"fn": loss_fn, "factor": factor, "scaler": None, "sink": sink},
        )
    except PipeliningMetadataError as error:
        msg = (
            f"a pipeline stage on rank {dist.rank} (stages {model.stage_ids}) returned what torch's stages "
            f"cannot pass on ({error}): each stage, the last included, must return a tensor or a tuple of "
            "tensors (return output['logits'] or output.logits rather than a dict or a model output; the "
            "loss function gets the last stage's tensor)"
        )
        raise UsageError(msg) from error
    object.__setattr__(model, "_warm", True)
    if early is not None:
        buffer, work = early
        work.wait()
        return buffer
    total = sink.finish() if sink is not None else torch.zeros((), dtype=torch.float32, device=dist.device)
    if not route.early:
        import torch.distributed as tdist

        tdist.broadcast(total, group=route.group, group_src=route.holder)
    return total


def _check_rows(args: tuple[Any, ...], targets: Any, count: int) -> None:
    """Refuse a batch whose tensors do not split into ``count`` equal micro-batches along dim 0."""
    tensors = [(f"inputs[{i}]", x) for i, x in enumerate(args) if isinstance(x, torch.Tensor)]
    if isinstance(targets, torch.Tensor):
        tensors.append(("targets", targets))
    for name, x in tensors:
        rows = x.shape[0] if x.ndim else 0
        if rows < count or rows % count:
            msg = (
                f"forward_backward splits the batch into {count} micro-batches along dim 0, but {name} has "
                f"{rows} row(s), which {count} does not divide: give every step a batch of a multiple of "
                f"{count} rows (drop_last=True in the DataLoader), or faccel.Schedule(microbatches=k) with "
                "k dividing the batch"
            )
            raise ArgumentValueError(msg)


def _expect_loss(route: _LossRoute, device: torch.device) -> tuple[torch.Tensor, Any]:
    """The loss's buffer on a rank without the last stage, and its receive, posted now (gloo)."""
    import torch.distributed as tdist

    buffer = torch.empty((), dtype=torch.float32, device=device)
    work = tdist.irecv(buffer, group=route.group, group_src=route.holder, tag=_LOSS_TAG)
    return buffer, work


def clip_stages(
    dist: DistState,
    params: list[torch.Tensor],
    max_norm: float,
    *,
    norm_type: float,
    error_if_nonfinite: bool,
    foreach: bool | None,
) -> torch.Tensor:
    """Clip this rank's stage gradients by the norm over every stage of the pipeline; return that norm.

    Each stage's norm is made whole over its own meshes (``full_tensor``: the
    data-parallel and tensor ranks of its block), then the stages' norms are
    combined over the pipeline group (a sum of p-th powers, a max for ``inf``):
    the same number on every rank, the norm of the whole model's gradients.
    """
    import torch.distributed as tdist

    from faccel._dist._mesh import dimension_group

    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param)
    norms = [torch.zeros((), dtype=torch.float64)]
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in group if p.grad is not None], norm_type, foreach=foreach
        )
        full = getattr(norm, "full_tensor", None)
        norms.append((full() if full is not None else norm).double().cpu())
    local = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    inf = norm_type == float("inf")
    value = (local if inf else local**norm_type).to(dist.device)
    op = tdist.ReduceOp.MAX if inf else tdist.ReduceOp.SUM
    peers = [r for r in dist.parallel.members("pipeline", dist.rank) if r != dist.rank]
    with region(dist, "clip_grad_norm() over the pipeline stages", peers):
        tdist.all_reduce(value, op=op, group=dimension_group(dist, "pipeline"))
    total = (value if inf else value ** (1.0 / norm_type)).float().cpu()
    if error_if_nonfinite and not torch.isfinite(total):
        msg = f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()})"
        raise RuntimeError(msg)
    for group in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total, foreach=foreach)
    return total
