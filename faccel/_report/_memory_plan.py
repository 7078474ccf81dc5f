"""A memory plan before launch: the bytes each rank holds under each candidate layout.

:func:`estimate_memory` builds the model with no storage (fake CPU tensors, or meta),
reads every parameter's shape and dtype, and reports for each layout, per rank
(the largest rank), the bytes of parameters, gradients, optimizer state, buffers
and what a step holds in flight, plus the largest tensor (what a sharded
``save_model`` or ``load_model`` holds at once) and, when inputs are given, the
activations one forward saves for backward, counted on those storage-less tensors
(nothing is allocated). ``python -m faccel plan`` is its command line (Accelerate's
``accelerate estimate-memory``).

Three parts, each its own module: the arithmetic, pure (``_memory_arith``: one
rank's bytes of a tensor under a layout, FSDP2's and tensor parallelism's
rules); the build with no storage (``_memory_build``: the model, its
parameters' shapes, the activations); the candidates' spellings
(``_memory_parse``: a table). This module puts them together.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from torch import nn

from faccel._dist._layout import Layout
from faccel._report._memory_arith import (
    OPTIMIZER_STATES,
    LayoutPlan,
    ParamSpec,
    layout_plan,
    numel,
    rank_bytes,
    shard_rows,
    stage_cuts,
)
from faccel._report._memory_build import activation_bytes, build_model, param_specs
from faccel._report._memory_parse import parse_candidate
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError

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
    "stage_cuts",
]


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
        >>> import torch
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
        ArgumentValueError: A candidate that does not span ``world_size`` ranks, an unknown optimizer,
            or a model with no parameters or one of an empty shape (a size of 0 in its config).

    Example:
        >>> import torch
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
    built, fake = build_model(model)
    candidates = [
        candidate if isinstance(candidate, Layout) else parse_candidate(candidate, world_size)
        for candidate in (layouts if layouts is not None else ["ddp", "fsdp"])
    ]
    for layout in candidates:
        if layout.world_size != world_size:
            msg = f"layout {layout} spans {layout.world_size} ranks, but the world size is {world_size}"
            raise ArgumentValueError(msg)
    specs = param_specs(built, tp_plan)
    empty = next((spec for spec in specs if numel(spec.shape) == 0), None)
    if not specs or empty is not None:
        said = "no parameters" if empty is None else f"parameter {empty.name} of shape {list(empty.shape)}"
        msg = (
            f"the {type(built).__name__} has {said}: a plan of it would be a table of zeros. Its config "
            "probably gives a size of 0 or below (n_embd=0, n_layer=-3); fix the config or the function"
        )
        raise ArgumentValueError(msg)
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
        parameters=sum(numel(spec.shape) for spec in specs),
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
