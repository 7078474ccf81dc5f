"""ZeRO's state as whole tensors: gathered for checkpoints and ``save_model``, scattered back at restore.

A checkpoint of a DeepSpeed run holds what an unsharded run's holds: the model's whole tensors
and an optimizer state dict keyed by parameter index over whole tensors (the torch form), so it
restores at any world size and any ZeRO stage. The tensors are ZeRO's own: :func:`full_state`
reads the fp32 master weights and optimizer state from each rank's flat partitions one parameter
at a time, :func:`load_full_state` writes them back (which keeps a resume bitwise), and
:func:`gather_named` gathers a shard's weights for ``save_model``. Never DeepSpeed's
``engine.save_checkpoint``, which pickles. The engine itself is built in ``_deepspeed``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from faccel._dist._state import DistState
from faccel._loop._strategies._deepspeed._engine import DeepSpeedOptimizer, is_deepspeed_engine, whole_shape

__all__ = [
    "FP32_MASTER",
    "full_state",
    "gather_named",
    "gathered_tensors",
    "has_partitioned_parameters",
    "load_full_state",
    "target_state",
    "whole_specs",
]

# An optimizer state entry of a parameter whose model dtype is not float32: ZeRO's fp32 master.
FP32_MASTER = "fp32_master"
# The engine's counters a resume carries over.
_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")


def _partitioned(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "ds_id")


def _stage(engine: Any) -> int:
    return int(engine.zero_optimization_stage())


def target_state(engine: Any) -> dict[str, torch.Tensor]:
    """The module's state dict as a checkpoint sees it: a ZeRO-3 partitioned parameter as a ``meta``
    tensor of its whole shape and dtype (no data, no communication)."""
    return {
        name: torch.empty(whole_shape(t), dtype=t.dtype, device="meta") if _partitioned(t) else t
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
        specs[name] = (tensor.dtype, whole_shape(tensor) if _partitioned(tensor) else tuple(tensor.shape))
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
    _load_module(engine, model_state)
    if _stage(engine) == 0:
        if optimizer is not None and optimizer_state is not None:
            optimizer.optimizer.load_state_dict(dict(optimizer_state))
        _load_masters(engine, {}, model_state)  # DeepSpeed's fp16/bf16 optimizer at stage 0
        return
    saved_state: Mapping[int, Mapping[str, Any]] = optimizer_state["state"] if optimizer_state else {}
    groups = optimizer.groups if optimizer is not None else []
    if optimizer is not None and optimizer_state is not None:
        _load_partition_states(engine, optimizer, optimizer_state)
        _load_counters(engine, optimizer_state)
    index_of = {id(p): i for i, p in enumerate(p for params in groups for p in params)}
    _load_masters(engine, {p: saved_state[i] for p, i in index_of.items() if i in saved_state}, model_state)


def _load_module(engine: Any, model_state: Mapping[str, torch.Tensor]) -> None:
    """The module's tensors, each ZeRO-3 partitioned one gathered, set on rank 0's copy and
    partitioned again (a collective under ZeRO-3); a name ``model_state`` lacks is left as it is."""
    import deepspeed

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


def _load_partition_states(engine: Any, optimizer: Any, optimizer_state: Mapping[str, Any]) -> None:
    """The torch groups' hyperparameters, and each flat partition's optimizer state entry made
    anew from the saved one of its group's first parameter: scalars (the step) as saved, each
    elementwise tensor a placeholder of the partition's shape that ``_load_masters`` fills."""
    saved_state: Mapping[int, Mapping[str, Any]] = optimizer_state["state"]
    first_ids: dict[int, int] = {}
    index = 0
    for number, params in enumerate(optimizer.groups):
        for _ in params:
            if index in saved_state:
                first_ids.setdefault(number, index)
            index += 1
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


def _load_counters(engine: Any, optimizer_state: Mapping[str, Any]) -> None:
    """The engine's step counters and the fp16 loss scaler's numbers, as saved."""
    saved = optimizer_state.get("deepspeed", {})
    counters = saved.get("counters", {})
    for name in _COUNTERS:
        if name in counters:
            setattr(engine, name, int(counters[name]))
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for key, value in saved.get("loss_scaler", {}).items():
        if scaler is not None and hasattr(scaler, key):
            setattr(scaler, key, value)


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
