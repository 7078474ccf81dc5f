"""A memory plan before launch: the bytes each rank holds under each candidate layout.

:func:`estimate_memory` builds the model with no storage (fake CPU tensors, or meta),
reads every parameter's shape and dtype, and reports for each layout, per rank
(the largest rank), the bytes of parameters, gradients, optimizer state, buffers
and what a step holds in flight, plus the largest tensor (what a sharded
``save_model`` or ``load_model`` holds at once) and, when inputs are given, the
activations one forward saves for backward, counted on those storage-less tensors
(nothing is allocated). ``python -m faccel plan`` is its command line (Accelerate's
``accelerate estimate-memory``).

The core is pure: :func:`rank_bytes` computes one rank's share of one tensor
from its shape, dtype and the layout, with FSDP2's rule (dim 0 cut into
``ceil(rows / shard)`` pieces, rank ``s`` taking piece ``s``) after tensor
parallelism's split of the dim its plan names.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from faccel._dist._layout import Layout, parse_layout, strategy_for
from faccel._loop._strategies._mesh._tp_plan import plan_key_matches
from faccel._torch_compat import fake_tensors, view_base
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentError, ArgumentValueError

__all__ = [
    "OPTIMIZER_STATES",
    "LayoutPlan",
    "MemoryPlan",
    "ParamSpec",
    "activation_bytes",
    "estimate_memory",
    "layout_plan",
    "param_specs",
    "parse_candidate",
    "rank_bytes",
    "shard_rows",
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
        return _numel(self.shape) * self.itemsize


def _numel(shape: tuple[int, ...]) -> int:
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
    return _numel(tuple(shape)) * spec.itemsize


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


# ParallelStyle -> (the dim it splits of an nn.Linear's weight, of its bias, of an nn.Embedding's weight).
_STYLE_DIMS: Mapping[str, tuple[int | None, int | None, int | None]] = {
    "ColwiseParallel": (0, 0, 1),
    "RowwiseParallel": (1, None, 0),
}


def _tensor_dims(model: nn.Module, tp_plan: Mapping[str, Any] | None) -> dict[str, int]:
    """Parameter name -> the dim ``tp_plan`` splits (Colwise/Rowwise on ``nn.Linear``, ``nn.Embedding``)."""
    dims: dict[str, int] = {}
    for path, module in model.named_modules():
        style = next(
            (s for key, s in (tp_plan or {}).items() if path and plan_key_matches(key, path)),
            None,
        )
        rule = _STYLE_DIMS.get(type(style).__name__) if style is not None else None
        if rule is None:
            continue
        weight_dim, bias_dim, embedding_dim = rule
        for name, dim in (
            ("weight", embedding_dim if isinstance(module, nn.Embedding) else weight_dim),
            ("bias", bias_dim),
        ):
            if dim is not None and getattr(module, name, None) is not None:
                dims[f"{path}.{name}"] = dim
    return dims


def _units(model: nn.Module) -> dict[str, str]:
    """Parameter name -> the FSDP2 unit that owns it under faccel's default policy (innermost unit)."""
    from faccel._loop._model import default_shard_policy

    policy = default_shard_policy(model)
    paths = [path for path, module in model.named_modules() if path and policy(module)]
    out = {}
    for name, _ in model.named_parameters():
        owners = [p for p in paths if name.startswith(p + ".")]
        out[name] = max(owners, key=len, default="")
    return out


def param_specs(model: nn.Module, tp_plan: Mapping[str, Any] | None = None) -> list[ParamSpec]:
    """``model``'s parameters (tied ones once) as :class:`ParamSpec` records; reads shapes only.

    Example:
        >>> with torch.device("meta"):
        ...     net = torch.nn.Linear(3, 2)
        >>> [(s.name, s.shape, s.itemsize) for s in param_specs(net)]
        [('weight', (2, 3), 4), ('bias', (2,), 4)]
    """
    dims = _tensor_dims(model, tp_plan)
    units = _units(model)
    return [
        ParamSpec(
            name=name,
            shape=tuple(param.shape),
            itemsize=param.element_size(),
            tensor_dim=dims.get(name),
            trainable=param.requires_grad,
            unit=units[name],
        )
        for name, param in model.named_parameters()
    ]


def activation_bytes(model: nn.Module, inputs: Any, fake: Any = None) -> int:
    """Bytes of the tensors one forward of ``model`` on ``inputs`` saves for backward; nothing allocated.

    ``inputs`` is a tuple of positional arguments or a mapping of keyword
    arguments. ``model`` is on meta, or was built in ``fake`` (a
    ``faccel._torch_compat.fake_tensors()`` context, as :func:`estimate_memory`
    builds a model from its function). On meta, the inputs are moved to meta
    and attention runs as SDPA's math kernel (the one the meta device has),
    which saves the softmax. With ``fake``, the inputs become fake CPU tensors
    of their shapes and dtypes, and every op dispatches as on the CPU: the
    count is a real CPU forward's, byte for byte.

    Each saved storage counts once (a view counts its base); the parameters a
    layer saves are not activations and are left out. Counted with
    ``torch.autograd.graph.saved_tensors_hooks``: what a forward holds until
    its backward, which dominates the activation memory of a step.

    Example:
        >>> with torch.device("meta"):
        ...     net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        >>> activation_bytes(net, (torch.zeros(3, 8),))  # the input, the ReLU's output (saved twice)
        288
    """
    params = {id(p) for p in model.parameters()}
    seen: dict[int, torch.Tensor] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        root = view_base(tensor)
        if id(tensor) not in params and id(root) not in params:
            seen.setdefault(id(root), root)
        return tensor

    def moved(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if fake is None:
            return value.to("meta")
        return torch.zeros(value.shape, dtype=value.dtype)  # in the fake mode: a shape, no storage

    with contextlib.ExitStack() as stack:
        if fake is not None:
            stack.enter_context(fake)
        stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor))
        stack.enter_context(torch.enable_grad())
        if isinstance(inputs, Mapping):
            model(**{key: moved(value) for key, value in inputs.items()})
        else:
            model(*(moved(value) for value in inputs))
    return sum(t.numel() * t.element_size() for t in seen.values())


def parse_candidate(text: str, world_size: int) -> Layout:
    """The layout a candidate names: ``ddp``, ``fsdp``, ``hsdp:RxS``, ``tp:T``, ``pp:P`` (FSDP2 then), a grid.

    A grid is ``RxSxT`` (replicate x shard x tensor: ``2x2x2``) or a layout as
    ``str(Layout)`` writes it (``replicate=2,shard=4``).

    Raises:
        ArgumentValueError: An unknown spelling, or sizes whose product is not ``world_size``.

    Example:
        >>> parse_candidate("ddp", 8), parse_candidate("hsdp:2x4", 8)
        (Layout(replicate=8, shard=1, tensor=1), Layout(replicate=2, shard=4, tensor=1))
        >>> parse_candidate("tp:2", 8), parse_candidate("2x2x2", 8)
        (Layout(replicate=1, shard=4, tensor=2), Layout(replicate=2, shard=2, tensor=2))
        >>> parse_candidate("pp:2", 8)
        Layout(replicate=1, shard=4, tensor=1, pipeline=2)
    """
    name, _, sizes = text.strip().partition(":")
    try:
        if name == "ddp" and not sizes:
            layout = Layout(replicate=world_size)
        elif name == "fsdp" and not sizes:
            layout = Layout(shard=world_size)
        elif name == "hsdp" and sizes:
            replicate, shard = (int(x) for x in sizes.split("x"))
            layout = Layout(replicate=replicate, shard=shard)
        elif name == "pp" and sizes:
            pipeline = int(sizes)
            layout = Layout(pipeline=pipeline, shard=max(world_size // pipeline, 1))
        elif name == "tp" and sizes:
            tensor = int(sizes)
            layout = Layout(shard=max(world_size // tensor, 1), tensor=tensor)
        elif text.count("x") == 2 and text.replace("x", "").strip().isdigit():
            replicate, shard, tensor = (int(x) for x in text.split("x"))
            layout = Layout(replicate=replicate, shard=shard, tensor=tensor)
        else:
            layout = parse_layout(text)
    except (ValueError, ArgumentValueError) as error:
        msg = (
            "a candidate layout is 'ddp', 'fsdp', 'hsdp:RxS', 'tp:T', 'pp:P', 'RxSxT' or "
            f"'replicate=R,shard=S,tensor=T', "
            f"got {text!r} ({error})"
        )
        raise ArgumentValueError(msg) from None
    if layout.world_size != world_size:
        msg = f"candidate {text!r} is {layout}, {layout.world_size} ranks, but the world size is {world_size}"
        raise ArgumentValueError(msg)
    return layout


def _gib(n: int | None, unit: int = 2**30) -> str:
    return "-" if n is None else f"{n / unit:.3f}"


@attrs.frozen
class MemoryPlan:
    """What a model needs per rank under each candidate layout (bytes); ``str()`` is the table.

    Attributes:
        parameters: The model's parameters (elements; tied ones once).
        parameter_bytes: Their bytes, whole.
        largest: The largest tensor's name and bytes: what a sharded ``save_model``
            or ``load_model`` holds in flight.
        optimizer: The optimizer whose state is counted.
        activations: The activations one forward saves for backward (None: not measured).
        activations_note: How they were measured, or why not.
        layouts: One :class:`LayoutPlan` per candidate.

    Example:
        >>> plan = estimate_memory(lambda: torch.nn.Linear(1024, 1024), 2)
        >>> [(str(row.layout), row.parameters) for row in plan.layouts]
        [('replicate=2,shard=1,tensor=1', 4198400), ('replicate=1,shard=2,tensor=1', 2099200)]
        >>> print(str(plan).splitlines()[0])
        Linear: 1.05M parameters, 4.004 MiB; largest tensor weight 4.000 MiB; optimizer adamw
    """

    model: str
    parameters: int
    parameter_bytes: int
    largest: tuple[str, int]
    optimizer: str
    activations: int | None
    activations_note: str
    layouts: tuple[LayoutPlan, ...]

    def __str__(self) -> str:
        # GiB, or MiB for a model whose every figure is below a GiB.
        big = max([self.parameter_bytes, *(r.total for r in self.layouts)]) >= 2**30
        unit, name = (2**30, "GiB") if big else (2**20, "MiB")
        head = (
            f"{self.model}: {self.parameters / 1e6:.2f}M parameters, {_gib(self.parameter_bytes, unit)} "
            f"{name}; largest tensor {self.largest[0]} {_gib(self.largest[1], unit)} {name}; "
            f"optimizer {self.optimizer}"
        )
        lines = [
            head,
            f"activations: {self.activations_note}",
            f"{name} per rank (the largest rank)",
            f"{'layout':<32} {'strategy':<8} {'params':>8} {'grads':>8} {'optim':>8} {'buffers':>8} "
            f"{'in flight':>9} {'activ.':>8} {'peak':>8} {'sum':>8}",
        ]
        for row in self.layouts:
            lines.append(
                f"{row.layout!s:<32} {row.strategy:<8} {_gib(row.parameters, unit):>8} "
                f"{_gib(row.gradients, unit):>8} {_gib(row.optimizer, unit):>8} {_gib(row.buffers, unit):>8} "
                f"{_gib(row.in_flight, unit):>9} {_gib(row.activations, unit):>8} {_gib(row.peak, unit):>8} "
                f"{_gib(row.total, unit):>8}" + (f"  ({row.note})" if row.note else "")
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready values (``python -m faccel plan --json``)."""
        return {
            "model": self.model,
            "parameters": self.parameters,
            "parameter_bytes": self.parameter_bytes,
            "largest": {"name": self.largest[0], "bytes": self.largest[1]},
            "optimizer": self.optimizer,
            "activations": self.activations,
            "activations_note": self.activations_note,
            "layouts": [
                {
                    "layout": str(row.layout),
                    "strategy": row.strategy,
                    **{
                        key: getattr(row, key)
                        for key in ("parameters", "gradients", "optimizer", "buffers", "in_flight")
                    },
                    "activations": row.activations,
                    "peak": row.peak,
                    "total": row.total,
                    "note": row.note,
                }
                for row in self.layouts
            ],
        }


def _build(model: nn.Module | Callable[[], nn.Module] | str) -> tuple[nn.Module, Any]:
    """The model, and the fake-tensor context it was built in (None: built on meta, or given)."""
    if isinstance(model, nn.Module):
        return model, None
    if isinstance(model, str):
        module_name, _, function = model.partition(":")
        if not module_name or not function:
            msg = f"a model is named 'module:function' (a function that builds it), got {model!r}"
            raise ArgumentValueError(msg)
        model = getattr(importlib.import_module(module_name), function)
    if not callable(model):
        msg = f"model must be an nn.Module, a callable that builds one or 'module:function', got {model!r}"
        raise ArgumentError(msg)
    fake = fake_tensors()
    try:
        with fake:  # a CPU model with no storage: its forward dispatches as on the CPU
            built = model()
    except Exception:  # a constructor that reads values (.item()): build on meta instead
        fake = None
        with torch.device("meta"):
            built = model()
    if not isinstance(built, nn.Module):
        msg = f"the model function returned a {type(built).__name__}, not an nn.Module"
        raise ArgumentError(msg)
    return built, fake


@setup_checked
def estimate_memory(
    model: nn.Module | Callable[[], nn.Module] | str,
    world_size: int,
    layouts: Iterable[Layout | str] | None = None,
    *,
    optimizer: str = "adamw",
    inputs: Any = None,
    tp_plan: Mapping[str, Any] | None = None,
    split: Sequence[str] | None = None,
    schedule: Any = None,
) -> MemoryPlan:
    """The bytes each rank needs under each candidate layout, from a model built with no storage.

    Args:
        model: A function that builds the model (called in a fake-tensor context:
            CPU tensors with no storage; on meta if its constructor reads values),
            its ``"module:function"`` path, or a model (on meta or not: only shapes are read).
        world_size: The ranks of the job.
        layouts: Candidates: :class:`Layout` values or ``"ddp"``, ``"fsdp"``,
            ``"hsdp:RxS"``, ``"tp:T"`` (T tensor ranks, FSDP2 over the rest), or
            ``"replicate=R,shard=S,tensor=T"``. Default: DDP and FSDP2 over every rank.
        optimizer: Whose state to count: ``"adamw"`` / ``"adam"`` (2 tensors a
            parameter), ``"sgd"`` (momentum: 1) or ``"none"``; each state tensor
            has its parameter's dtype, as torch's optimizers make them.
        inputs: One rank's batch, a tuple of arguments or a mapping of keyword
            arguments (only their shapes and dtypes are used): with it, the activations of one
            forward are counted (:func:`activation_bytes`); the same per rank
            in every layout (tensor parallelism may divide some of them).
        tp_plan: The ``parallelize_module`` plan ``prepare`` would get: which
            ``nn.Linear`` / ``nn.Embedding`` tensors ``ColwiseParallel`` and
            ``RowwiseParallel`` split over the tensor ranks.
        split: Under pipeline layouts (``pp:P``): the module names where a stage
            begins, as ``prepare(split=...)``; default: stages of about equal bytes.
        schedule: Under pipeline layouts: the ``faccel.Schedule`` (default 1F1B,
            one micro-batch per stage); it sets the stages per rank and how many
            micro-batches' activations a rank holds at once.

    Returns:
        A :class:`MemoryPlan`; ``str()`` of it is the table ``python -m faccel plan`` prints.

    Raises:
        ArgumentError: ``model`` is none of the accepted kinds, or an argument of the wrong type.
        ArgumentValueError: A candidate that does not span ``world_size`` ranks, or an unknown optimizer.

    Example:
        >>> build = lambda: torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 8))
        >>> plan = estimate_memory(build, 4, ["ddp", "fsdp"], inputs=(torch.zeros(16, 512),))
        >>> ddp, fsdp = plan.layouts
        >>> ddp.parameters == 4 * fsdp.parameters, fsdp.optimizer == 2 * fsdp.parameters
        (True, True)
        >>> plan.activations  # the input and the first layer's output, 16 x 512 float32 each
        65536
    """
    if type(world_size) is not int or world_size < 1:
        msg = f"world_size must be an int >= 1, got {world_size!r}"
        raise ArgumentValueError(msg)
    if optimizer not in OPTIMIZER_STATES:
        msg = f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {optimizer!r}"
        raise ArgumentValueError(msg)
    built, fake = _build(model)
    candidates = [
        candidate if isinstance(candidate, Layout) else parse_candidate(candidate, world_size)
        for candidate in (layouts if layouts is not None else ["ddp", "fsdp"])
    ]
    for layout in candidates:
        if layout.world_size != world_size:
            msg = f"layout {layout} spans {layout.world_size} ranks, but the world size is {world_size}"
            raise ArgumentValueError(msg)
    specs = param_specs(built, tp_plan)
    buffers = sum(b.numel() * b.element_size() for b in built.buffers())
    activations: int | None = None
    if inputs is None:
        note = "not measured (give inputs: one rank's batch)"
    elif fake is None and not all(p.is_meta for p in built.parameters()):
        note = "not measured (the model is not on meta; pass a function that builds it)"
    else:
        kind = "fake CPU tensors" if fake is not None else "meta tensors (attention by SDPA's math kernel)"
        try:
            activations = activation_bytes(built, inputs, fake)
        except Exception as error:  # a forward that needs real data (.item(), a data-dependent branch)
            note = f"not measured: a forward on {kind} failed ({type(error).__name__}: {error})"[:300]
        else:
            note = f"one forward's tensors saved for backward, counted on {kind}"
    largest = max(specs, key=lambda spec: spec.nbytes, default=ParamSpec("-", (0,), 1))
    return MemoryPlan(
        model=type(built).__name__,
        parameters=sum(_numel(spec.shape) for spec in specs),
        parameter_bytes=sum(spec.nbytes for spec in specs),
        largest=(largest.name, largest.nbytes),
        optimizer=optimizer,
        activations=activations,
        activations_note=note,
        layouts=tuple(
            layout_plan(
                specs,
                layout,
                optimizer=optimizer,
                buffers=buffers,
                activations=activations,
                split=split,
                schedule=schedule,
            )
            for layout in candidates
        ),
    )
