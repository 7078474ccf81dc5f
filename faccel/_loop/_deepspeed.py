"""DeepSpeed ZeRO (stages 0-3) as a strategy: the config faccel fills, the engine, the seed loop's seams.

The one module that imports ``deepspeed``, and only inside the functions that
build an engine: importing faccel never imports it. The config is a value:
:func:`faccel._dist._deepspeed_config.read_config` turns a dict or a JSON file into canonical JSON text that
``DistState.deepspeed`` holds, and :func:`fill_config` (pure) completes it
with what faccel knows (docs/deepspeed.md):

* ``train_micro_batch_size_per_gpu``: the prepared loader's batch size;
* ``gradient_accumulation_steps``: ``dist.accumulation_steps``;
* ``train_batch_size``: their product times the data-parallel world size;
* ``fp16`` / ``bf16``: ``dist.precision``;
* ``gradient_clipping``: 0 unless the config asks for a value (DeepSpeed's
  own default, 1.0, would clip silently).

A value the config states that contradicts one of these is a
:class:`~faccel.errors.DeepSpeedConfigError`, never a silent winner.

The seed loop runs unchanged: ``prepare`` returns the engine as the model and
a :class:`DeepSpeedOptimizer` whose ``step`` is the engine's; ``backward``
finds the engine from the loss's graph and runs the engine's backward with
faccel's micro-step as the accumulation boundary.

Checkpoints, ``save_model`` and ``load_model`` see ZeRO's state as whole
tensors: :func:`full_state` gathers the module and ZeRO's fp32 masters and
optimizer state partitions one parameter at a time (the torch optimizer's form,
keyed by parameter index), :func:`load_full_state` scatters them back into any
world size and stage, and :func:`gather_named` gathers a shard's weights for
``save_model``. DeepSpeed's own ``save_checkpoint`` (pickle) is never used.
"""

from __future__ import annotations

import json
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from faccel._dist._state import DistState
from faccel._marks import DEEPSPEED_ENGINE
from faccel.errors import DeepSpeedConfigError, PrepareError, UsageError

__all__ = [
    "DeepSpeedOptimizer",
    "engine_backward",
    "fill_config",
    "full_state",
    "gather_named",
    "gathered_tensors",
    "has_partitioned_parameters",
    "is_deepspeed_engine",
    "load_full_state",
    "prepare_deepspeed",
    "target_state",
    "whole_specs",
]

# The values meaning "faccel, fill this in" (Accelerate's and HF Trainer's spelling).
_AUTO = "auto"
# Sections that would make DeepSpeed build its own optimizer or schedule: faccel's loop
# steps the torch optimizer and scheduler the user prepared.
_REFUSED_SECTIONS = ("optimizer", "scheduler")
# Set on each Parameter of an engine's module: the engine (weakly), for backward() to find
# from the loss's graph. (A mark on user objects, as _prepare's _REPLACED_BY.)
_ENGINE = DEEPSPEED_ENGINE


def _given(value: Any) -> bool:
    return value is not None and value != _AUTO


def _agree(config: dict[str, Any], key: str, faccel_value: Any, source: str) -> None:
    value = config.get(key)
    if _given(value) and value != faccel_value:
        msg = (
            f"the deepspeed config says {key}={value!r} but {source} gives {faccel_value!r}; "
            f"remove the key (or set it to 'auto') and faccel fills it, or change {source}"
        )
        raise DeepSpeedConfigError(msg)
    config[key] = faccel_value


def _precision_section(config: dict[str, Any], name: str, wanted: bool, precision: str) -> None:
    section = config.get(name)
    if section is None:
        section = {}
    if not isinstance(section, dict):
        msg = f"the deepspeed config's {name!r} must be a JSON object, got {section!r}"
        raise DeepSpeedConfigError(msg)
    section = dict(section)
    enabled = section.get("enabled")
    if _given(enabled) and bool(enabled) != wanted:
        msg = (
            f"the deepspeed config says {name}.enabled={enabled!r} but dist.precision is "
            f"{precision!r}; set precision in faccel.detect(precision=...) and remove "
            f"{name}.enabled (or set it to 'auto')"
        )
        raise DeepSpeedConfigError(msg)
    section["enabled"] = wanted
    config[name] = section


def fill_config(config: str, *, dist: DistState, micro_batch_size: int | None) -> dict[str, Any]:
    """The DeepSpeed config that ``config`` (JSON text) and faccel's own facts make together. Pure.

    Args:
        config: JSON text from :func:`read_config` (``dist.deepspeed``).
        dist: The run's :class:`DistState`: accumulation, precision, world size.
        micro_batch_size: The prepared loader's batch size per rank, or None
            when no loader was prepared with the model (then the config must say it).

    Returns:
        The config dict to build the engine from.

    Raises:
        DeepSpeedConfigError: A stated value contradicts faccel's, the config
            has an ``optimizer`` or ``scheduler`` section, the ZeRO stage is
            not 0-3, or no micro-batch size is known.

    Example:
        >>> dist = DistState.simulated(world_size=2, accumulation_steps=3, precision="bf16")
        >>> c = fill_config('{"zero_optimization": {"stage": 2}}', dist=dist, micro_batch_size=4)
        >>> (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"],
        ...  c["train_batch_size"], c["bf16"]["enabled"], c["fp16"]["enabled"], c["gradient_clipping"])
        (4, 3, 24, True, False, 0.0)
        >>> fill_config('{"gradient_accumulation_steps": 2}', dist=dist, micro_batch_size=4)
        Traceback (most recent call last):
        ...
        faccel.errors.DeepSpeedConfigError: the deepspeed config says gradient_accumulation_steps=2 ...
    """
    filled: dict[str, Any] = json.loads(config)
    for section in _REFUSED_SECTIONS:
        if section in filled:
            msg = (
                f"the deepspeed config has an {section!r} section, but faccel's loop steps the torch "
                f"{section} you prepare; remove the section and build the {section} in torch "
                "(torch.optim.AdamW(...), torch.optim.lr_scheduler...)"
            )
            raise DeepSpeedConfigError(msg)
    zero = filled.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage not in (0, 1, 2, 3):
        msg = f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}"
        raise DeepSpeedConfigError(msg)
    if micro_batch_size is None:
        micro_batch_size = filled.get("train_micro_batch_size_per_gpu")
        if not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool):
            msg = (
                "no loader was prepared with the model, so faccel cannot fill "
                "train_micro_batch_size_per_gpu; prepare the model, optimizer and loader in one "
                "faccel.prepare call, or state the size in the deepspeed config"
            )
            raise DeepSpeedConfigError(msg)
    _agree(filled, "train_micro_batch_size_per_gpu", micro_batch_size, "the prepared loader's batch size")
    _agree(filled, "gradient_accumulation_steps", dist.accumulation_steps, "dist.accumulation_steps")
    total = micro_batch_size * dist.accumulation_steps * dist.data_world_size
    _agree(filled, "train_batch_size", total, "batch size x accumulation steps x world size")
    _precision_section(filled, "fp16", dist.precision == "fp16", dist.precision)
    _precision_section(filled, "bf16", dist.precision == "bf16", dist.precision)
    clip = filled.get("gradient_clipping")
    if not _given(clip):
        clip = 0.0  # not DeepSpeed's 1.0: nothing is clipped that the user did not ask for
    if not isinstance(clip, int | float) or isinstance(clip, bool) or not math.isfinite(clip) or clip < 0:
        msg = f"gradient_clipping must be a number >= 0 (0: no clipping), got {clip!r}"
        raise DeepSpeedConfigError(msg)
    filled["gradient_clipping"] = float(clip)
    # A torch optimizer (AdamW, SGD...) is "untested" for DeepSpeed's ZeRO; it works exactly.
    filled.setdefault("zero_allow_untested_optimizer", True)
    filled.setdefault("steps_per_print", 2**31 - 1)  # faccel's trackers log; DeepSpeed stays quiet
    filled.setdefault("wall_clock_breakdown", False)
    return filled


def is_deepspeed_engine(model: object) -> bool:
    """Whether ``model`` is a DeepSpeed engine (looked up, never importing deepspeed).

    Example:
        >>> is_deepspeed_engine(torch.nn.Linear(1, 1))
        False
    """
    engine = sys.modules.get("deepspeed.runtime.engine")
    return engine is not None and isinstance(model, engine.DeepSpeedEngine)


class DeepSpeedOptimizer(torch.optim.Optimizer):
    """The optimizer ``prepare`` returns under ``strategy='deepspeed'``: the seed loop's seam to the engine.

    ``step()`` is the engine's step (ZeRO's partitioned update, clipping if the
    config asks, loss-scale bookkeeping under fp16); ``zero_grad()`` clears
    ZeRO's gradient partitions. ``param_groups`` and ``state`` are those of the
    torch optimizer you built, so an LR scheduler made on it (before or after
    ``prepare``) steps the learning rate DeepSpeed uses. The engine is
    :attr:`engine`; the torch optimizer :attr:`optimizer`.
    """

    def __init__(
        self,
        engine: nn.Module,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[Sequence[nn.Parameter]] | None = None,
    ) -> None:
        # Not Optimizer.__init__: the parameters (ZeRO's partitions) belong to the engine.
        self.engine = engine
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        # The model's parameters in each group, as the torch optimizer held them before ZeRO
        # replaced them by flat partitions: the order a checkpoint numbers them in.
        self.groups = [list(group) for group in groups] if groups is not None else []

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The torch optimizer's groups (their ``lr`` is the one DeepSpeed steps with)."""
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        """The torch optimizer's state (under ZeRO: of this rank's partitions)."""
        return self.optimizer.state

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """The engine's optimizer step (``engine.step()``); ``closure`` is refused (DeepSpeed has none)."""
        if closure is not None:
            msg = "a DeepSpeed step takes no closure; run the forward and faccel.backward before step()"
            raise UsageError(msg)
        self.engine.step()  # type: ignore[operator]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (ZeRO's partitions and the module's ``.grad``)."""
        self.engine.optimizer.zero_grad(set_to_none=set_to_none)  # type: ignore[union-attr]
        self.engine.zero_grad()  # type: ignore[operator]

    def checkpoint_groups(self) -> list[dict[str, Any]]:
        """The groups as a checkpoint numbers them: the torch groups' hyperparameters, and for
        ``params`` a ``meta`` stand-in of each model parameter's whole shape in float32 (the
        dtype ZeRO keeps optimizer state in)."""
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [_whole_meta(p) for p in params]}
            for group, params in zip(self.param_groups, self.groups, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        """Refused: ZeRO's state is gathered by every rank together, which ``faccel.checkpoint`` does."""
        msg = (
            "a DeepSpeed run's optimizer state lies in ZeRO's per-rank partitions, which every rank "
            "gathers together: save it with faccel.checkpoint(dist, state, root) on every rank (and "
            "load it with faccel.restore), not with optimizer.state_dict() (docs/deepspeed.md)"
        )
        raise UsageError(msg)

    def load_state_dict(self, state_dict: Any) -> None:
        """Refused, as :meth:`state_dict`: ``faccel.restore`` loads a DeepSpeed run."""
        self.state_dict()

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizer({self.optimizer!r})"


def _engine_of(loss: torch.Tensor) -> Any:
    """The engine whose parameters ``loss`` was computed from: the first one its graph reaches."""
    stack = [loss.grad_fn]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf (a parameter)
        if variable is not None:
            ref = getattr(variable, _ENGINE, None)
            engine = ref() if ref is not None else None
            if engine is not None:
                return engine
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    msg = (
        "under strategy='deepspeed' faccel.backward needs a loss computed by the model faccel.prepare "
        "returned (the DeepSpeed engine), but this loss's graph reaches none of its parameters; "
        "compute the loss from the prepared model's output"
    )
    raise UsageError(msg)


def engine_backward(loss: torch.Tensor, *, sync: bool, **kwargs: Any) -> None:
    """The engine's backward for ``loss`` (already divided by the micro-step's group size).

    ``sync`` (faccel's micro-step) is the accumulation boundary: ZeRO reduces
    the gradients for the step at the micro-step that syncs. DeepSpeed's own
    division by its accumulation steps is off (faccel divides by the group's
    real size, the last partial group of an epoch included), and fp16 loss
    scaling is DeepSpeed's.
    """
    engine = _engine_of(loss)
    engine.set_gradient_accumulation_boundary(sync)
    engine.backward(loss, scale_wrt_gas=False, retain_graph=bool(kwargs.pop("retain_graph", False)))
    if kwargs:
        msg = f"under strategy='deepspeed' backward takes only retain_graph, got {sorted(kwargs)}"
        raise UsageError(msg)


def _build(
    dist: DistState, model: nn.Module, optimizer: torch.optim.Optimizer, config: dict[str, Any]
) -> Any:
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if dist.device.type == "cuda" else "cpu")
    try:
        import deepspeed
    except ImportError:
        msg = (
            "strategy='deepspeed' needs DeepSpeed, which is not installed; "
            "pip install 'faccel[deepspeed]' (or choose strategy='fsdp')"
        )
        raise PrepareError(msg) from None
    model.to(dist.device)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,
        config=config,
        # One process (no group of faccel's): DeepSpeed makes its own from the environment.
        dist_init_required=not torch.distributed.is_initialized(),
    )
    ref = weakref.ref(engine)
    for param in engine.module.parameters():
        setattr(param, _ENGINE, ref)
    return engine


def prepare_deepspeed(
    dist: DistState, objs: Sequence[Any], prepare_other: Callable[[Any], Any]
) -> tuple[Any, ...]:
    """``prepare`` under ``strategy='deepspeed'``: loaders first (their batch size), then the engine.

    Args:
        dist: The run's :class:`DistState` (``dist.deepspeed`` holds the config).
        objs: The objects given to ``prepare``, in order.
        prepare_other: How ``prepare`` handles everything but the model and
            optimizer (loaders, schedulers, tags).

    Returns:
        The prepared objects in the given order: the engine for the model, a
        :class:`DeepSpeedOptimizer` for the optimizer.

    Raises:
        PrepareError: Not exactly one model with exactly one optimizer, or
            DeepSpeed is not installed.
        DeepSpeedConfigError: The config contradicts faccel (:func:`fill_config`).
    """
    models = [i for i, obj in enumerate(objs) if isinstance(obj, nn.Module)]
    optimizers = [i for i, obj in enumerate(objs) if isinstance(obj, torch.optim.Optimizer)]
    done = [
        i
        for i in models + optimizers
        if is_deepspeed_engine(objs[i]) or isinstance(objs[i], DeepSpeedOptimizer)
    ]
    if done and len(done) == len(models) + len(optimizers):
        prepared = {i: objs[i] for i in done}
    elif len(models) != 1 or len(optimizers) != 1:
        msg = (
            f"under strategy='deepspeed' prepare builds one DeepSpeed engine from one model and its "
            f"optimizer, got {len(models)} model(s) and {len(optimizers)} optimizer(s); pass the model, "
            "its torch optimizer and the training loader in one faccel.prepare call"
        )
        raise PrepareError(msg)
    else:
        prepared = {}
    others = {i: prepare_other(obj) for i, obj in enumerate(objs) if i not in models + optimizers}
    if not prepared:
        sizes = [
            getattr(others[i], "batch_size", None) for i in sorted(others) if hasattr(others[i], "sharding")
        ]
        micro = next((size for size in sizes if isinstance(size, int)), None)
        config = fill_config(dist.deepspeed or "{}", dist=dist, micro_batch_size=micro)
        model, optimizer = objs[models[0]], objs[optimizers[0]]
        groups = [list(group["params"]) for group in optimizer.param_groups]
        engine = _build(dist, model, optimizer, config)
        prepared = {models[0]: engine, optimizers[0]: DeepSpeedOptimizer(engine, optimizer, groups)}
    return tuple(prepared[i] if i in prepared else others[i] for i in range(len(objs)))


# --- Checkpoints: ZeRO's partitions gathered into whole tensors, and scattered back ----------------
#
# A checkpoint of a DeepSpeed run holds what an unsharded run's holds: the model's whole tensors
# and an optimizer state dict keyed by parameter index over whole tensors (the torch form), so it
# restores at any world size and any ZeRO stage. The tensors are ZeRO's own: the fp32 master
# weights and optimizer state are read from (and written into) each rank's flat partitions, which
# keeps a resume bitwise. Never DeepSpeed's engine.save_checkpoint, which pickles.

# An optimizer state entry of a parameter whose model dtype is not float32: ZeRO's fp32 master.
FP32_MASTER = "fp32_master"
# The engine's counters a resume carries over.
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _whole_shape(param: torch.Tensor) -> tuple[int, ...]:
    shape = getattr(param, "ds_shape", None)  # ZeRO-3: the partitioned parameter's whole shape
    return tuple(shape) if shape is not None else tuple(param.shape)


def _whole_meta(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(_whole_shape(param), dtype=torch.float32, device="meta")


def _partitioned(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id")


def _stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def target_state(engine: Any) -> dict[str, torch.Tensor]:
    """The module's state dict as a checkpoint sees it: a ZeRO-3 partitioned parameter as a ``meta``
    tensor of its whole shape and dtype (no data, no communication)."""
    return {
        name: torch.empty(_whole_shape(t), dtype=t.dtype, device="meta") if _partitioned(t) else t
        for name, t in engine.module.state_dict(keep_vars=True).items()
    }


def gathered_tensors(engine: Any, *, keep: bool = True) -> Iterator[tuple[str, torch.Tensor | None]]:
    """The module's state dict, one whole tensor at a time: a ZeRO-3 parameter is gathered alone,
    copied to the CPU and released before the next (tied names share one copy). A collective under
    ZeRO-3: every rank iterates it to the end; with ``keep=False`` it yields None for a gathered one."""
    import deepspeed

    state = engine.module.state_dict(keep_vars=True)
    counts: dict[int, int] = {}
    for tensor in state.values():
        counts[id(tensor)] = counts.get(id(tensor), 0) + 1
    tied: dict[int, torch.Tensor | None] = {}
    for name, tensor in state.items():
        if id(tensor) in tied:
            yield name, tied[id(tensor)]
            continue
        value: torch.Tensor | None
        if _partitioned(tensor):
            with deepspeed.zero.GatheredParameters([tensor]):
                value = tensor.detach().to("cpu", copy=True) if keep else None
        else:
            value = tensor.detach()
        if counts[id(tensor)] > 1:
            tied[id(tensor)] = value
        yield name, value


def has_partitioned_parameters(model: object) -> bool:
    """Whether ``model`` is a DeepSpeed engine whose module holds ZeRO-3 partitioned parameters."""
    return is_deepspeed_engine(model) and any(_partitioned(p) for p in model.module.parameters())  # type: ignore[attr-defined]


def whole_specs(engine: Any) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], dict[str, str]]:
    """Each state dict name's whole dtype and shape, and the tied names ``{later: first}`` (one
    parameter under two names). No data, no communication."""
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        specs[name] = (tensor.dtype, _whole_shape(tensor) if _partitioned(tensor) else tuple(tensor.shape))
        if id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
    return specs, aliases


def gather_named(engine: Any, names: Sequence[str], *, keep: bool) -> dict[str, torch.Tensor]:
    """The whole tensors of ``names``, each ZeRO-3 parameter gathered alone and copied to the CPU
    (kept only where ``keep``). A collective under ZeRO-3: every rank calls it with the same names."""
    import deepspeed

    state = engine.module.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for name in names:
        tensor = state[name]
        if _partitioned(tensor):
            with deepspeed.zero.GatheredParameters([tensor]):
                if keep:
                    out[name] = tensor.detach().to("cpu", copy=True)
        elif keep:
            out[name] = tensor.detach()
    return out


def _flat_partitions(engine: Any) -> list[tuple[int, torch.Tensor]]:
    """This rank's flat fp32 partitions, each with the index of the torch param group it steps."""
    zero = engine.optimizer
    if hasattr(zero, "single_partition_of_fp32_groups"):  # ZeRO-1 and 2
        return list(enumerate(zero.single_partition_of_fp32_groups))
    return [(int(zero.sub_group_to_group_id[i]), f) for i, f in enumerate(zero.fp32_partitioned_groups_flat)]


def _check_optimizer(engine: Any, optimizer: Any, dist: DistState) -> DeepSpeedOptimizer | None:
    from faccel.errors import CheckpointError

    if optimizer is not None and not isinstance(optimizer, DeepSpeedOptimizer):
        msg = (
            "the TrainState of a DeepSpeed run must hold the optimizer faccel.prepare returned (a "
            f"DeepSpeedOptimizer), got a {type(optimizer).__name__}; pass the prepared one"
        )
        raise CheckpointError(msg)
    if optimizer is not None and _stage(engine) == 0 and dist.precision != "no":
        msg = (
            f"faccel cannot yet checkpoint a DeepSpeed run at ZeRO stage 0 with precision "
            f"{dist.precision!r} (DeepSpeed's own fp16/bf16 optimizer keeps its masters apart); use "
            "ZeRO stage 1, 2 or 3, whose checkpoints faccel writes (docs/deepspeed.md)"
        )
        raise CheckpointError(msg)
    return optimizer


def _relink(engine: Any, torch_state: Any) -> None:
    """ZeRO-1/2: point each parameter's fragment at its group's optimizer state anew.

    DeepSpeed links them once, after the first group's first step, when the later groups have no
    state yet (0.19: their fragments stay empty and ``safe_get_full_optimizer_state`` fails for
    them); relinked once every group has its state, and after a restore replaced the states."""
    zero = engine.optimizer
    if not hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        return
    zero._hp_optimizer_states_linked = False
    if all(torch_state.get(flat) for _, flat in _flat_partitions(engine)):
        zero._lazy_init_hp_params_optimizer_state()


def full_state(
    dist: DistState, engine: Any, optimizer: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The whole model state and the optimizer state (the torch form over whole tensors) of a
    DeepSpeed run, on the main process; other ranks get empty dicts. A collective: every rank calls it.

    Gathered one tensor at a time from ZeRO's partitions (``safe_get_full_fp32_param``,
    ``safe_get_full_optimizer_state``): bitwise ZeRO's values.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    keep = dist.is_main_process
    prepared = _check_optimizer(engine, optimizer, dist)
    gathered = list(gathered_tensors(engine, keep=keep))
    model_state = {name: t for name, t in gathered if t is not None} if keep else {}
    if prepared is None:
        return model_state, None
    if _stage(engine) == 0:
        return model_state, (prepared.optimizer.state_dict() if keep else {})
    torch_state = prepared.optimizer.state
    _relink(engine, torch_state)
    scalars: dict[int, dict[str, Any]] = {}
    elementwise: dict[int, list[str]] = {}
    for group, flat in _flat_partitions(engine):
        entry = torch_state.get(flat)
        if entry and group not in scalars:
            elementwise[group] = sorted(
                k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.shape == flat.shape
            )
            scalars[group] = {
                k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else v
                for k, v in entry.items()
                if k not in elementwise[group]
            }
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for number, (torch_group, params) in enumerate(zip(prepared.param_groups, prepared.groups, strict=True)):
        ids = []
        for param in params:
            entry = dict(scalars.get(number, {})) if param.requires_grad else {}
            for key in elementwise.get(number, []) if param.requires_grad else []:
                entry[key] = safe_get_full_optimizer_state(param, key).detach().to("cpu", copy=True)
            if param.dtype != torch.float32 and param.requires_grad:
                entry[FP32_MASTER] = safe_get_full_fp32_param(param).detach().to("cpu", copy=True)
            if keep and entry:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**{k: v for k, v in torch_group.items() if k != "params"}, "params": ids})
    if not keep:
        return model_state, {}
    counters = {name: int(getattr(engine, name)) for name in _COUNTERS}
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    scale = {
        k: v for k, v in (vars(scaler).items() if scaler is not None else ()) if type(v) in (int, float, bool)
    }
    return model_state, {
        "state": state,
        "param_groups": groups,
        "deepspeed": {"counters": counters, "loss_scaler": scale},
    }


def _set_partition(part: torch.Tensor, value: torch.Tensor, rank: int) -> None:
    """ZeRO-3: rank ``rank``'s padded partition ``part`` of the whole ``value``."""
    flat = value.detach().reshape(-1).to(part.device, part.dtype)
    piece = flat[part.numel() * rank : part.numel() * (rank + 1)]
    part.data[: piece.numel()].copy_(piece)


def load_full_state(
    engine: Any,
    optimizer: Any,
    model_state: Mapping[str, torch.Tensor],
    optimizer_state: Mapping[str, Any] | None,
) -> None:
    """Load whole tensors (:func:`full_state`'s form, from any world size and ZeRO stage) into a
    DeepSpeed run: the module, ZeRO's fp32 masters and optimizer state partitions, the torch groups'
    hyperparameters and the engine's counters. A collective under ZeRO-3: every rank calls it.

    Without an optimizer state (``load_model``), the masters are set from the weights: else the
    next step would put ZeRO's old masters back into the model."""
    import deepspeed

    stage = _stage(engine)
    with torch.no_grad():
        for name, target in engine.module.state_dict(keep_vars=True).items():
            value = model_state.get(name)
            if value is None:  # load_model(strict=False): a name the file lacks
                continue
            if _partitioned(target):
                with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                    target.data.copy_(value)
            else:
                target.data.copy_(value)
    if stage == 0:
        if optimizer is not None and optimizer_state is not None:
            optimizer.optimizer.load_state_dict(dict(optimizer_state))
        _load_masters(engine, {}, model_state)  # DeepSpeed's fp16/bf16 optimizer at stage 0
        return
    saved_state: Mapping[int, Mapping[str, Any]] = optimizer_state["state"] if optimizer_state else {}
    groups = optimizer.groups if optimizer is not None else []
    first_ids: dict[int, int] = {}
    index = 0
    for number, params in enumerate(groups):
        for _ in params:
            if index in saved_state:
                first_ids.setdefault(number, index)
            index += 1
    zero = engine.optimizer
    if optimizer is not None and optimizer_state is not None:
        for group, saved in zip(optimizer.param_groups, optimizer_state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k != "params"})
        torch_state = optimizer.optimizer.state
        for number, flat in _flat_partitions(engine):
            live = torch_state.get(flat) or {}
            if number not in first_ids:
                torch_state.pop(flat, None)
                continue
            fresh: dict[str, Any] = {}
            for key, value in saved_state[first_ids[number]].items():
                if key == FP32_MASTER:
                    continue
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    kept = live.get(key)
                    fit = isinstance(kept, torch.Tensor) and kept.shape == flat.shape
                    fresh[key] = kept if fit else torch.zeros_like(flat)
                else:
                    fresh[key] = value.clone().to(flat.device) if isinstance(value, torch.Tensor) else value
            torch_state[flat] = fresh
        _relink(engine, torch_state)
        counters = optimizer_state.get("deepspeed", {}).get("counters", {})
        for name in _COUNTERS:
            if name in counters:
                setattr(engine, name, int(counters[name]))
        scaler = getattr(zero, "loss_scaler", None)
        for key, value in optimizer_state.get("deepspeed", {}).get("loss_scaler", {}).items():
            if scaler is not None and hasattr(scaler, key):
                setattr(scaler, key, value)
    index_of = {id(p): i for i, p in enumerate(p for params in groups for p in params)}
    _load_masters(engine, {p: saved_state[i] for p, i in index_of.items() if i in saved_state}, model_state)


def _load_masters(
    engine: Any, saved: Mapping[int, Mapping[str, Any]], model_state: Mapping[str, torch.Tensor]
) -> None:
    """ZeRO's fp32 master of each parameter (saved, or its weight) and its optimizer state partitions;
    ``saved`` maps ``id(param)`` to its saved optimizer state."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    stage = _stage(engine)
    zero = engine.optimizer
    for name, param in engine.module.named_parameters():
        entry = saved.get(id(param), {})
        master = entry.get(FP32_MASTER, model_state.get(name))
        if not param.requires_grad or master is None:
            continue
        rank = zero._get_param_partition_rank(param) if stage == 3 else 0
        if stage == 3:
            part, _ = zero._get_fp32_opt_state_partition(param, release_swap_buffers=False)
            _set_partition(part, master, rank)
        else:
            safe_set_full_fp32_param(param, master.to(torch.float32))
        for key, value in entry.items():
            if key == FP32_MASTER or not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            if stage == 3:
                part, _ = zero._get_fp32_opt_state_partition(
                    param, release_swap_buffers=False, optim_state_key=key
                )
                _set_partition(part, value, rank)
            else:
                safe_set_full_optimizer_state(param, value.to(torch.float32), key)
