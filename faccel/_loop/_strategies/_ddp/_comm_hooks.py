"""DDP communication hooks through ``prepare``: fp16, bf16 and PowerSGD gradient compression.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...,
comm_state_option=...)`` as ``prepare(..., comm_hook=..., comm_hook_options=...)``.
The hooks are torch's own (``torch.distributed.algorithms.ddp_comm_hooks``),
registered on the ``DistributedDataParallel`` wrapper ``prepare`` returns; a
PowerSGD hook's state (its error feedback and iteration count) is torch's, held
by that wrapper. In one process there is no gradient communication and no
wrapper: the option is accepted and does nothing, so one script runs at any
size. Under FSDP2 or DeepSpeed (no DDP wrapper) it is refused by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal

from torch import nn

from faccel._dist._state import DistState
from faccel.errors import ArgumentValueError, PrepareError

__all__ = ["COMM_HOOKS", "CommHook", "check_comm_hook", "register_comm_hook"]

CommHook = Literal["fp16", "bf16", "powersgd", "batched_powersgd"]
COMM_HOOKS = ("fp16", "bf16", "powersgd", "batched_powersgd")
# What comm_hook_options may hold: PowerSGDState's keywords, and the compression wrapped around PowerSGD.
_POWERSGD_KEYS = (
    "matrix_approximation_rank",
    "start_powerSGD_iter",
    "min_compression_rate",
    "use_error_feedback",
    "warm_start",
    "orthogonalization_epsilon",
    "random_seed",
)
_WRAPPERS = ("fp16", "bf16")


def check_comm_hook(dist: DistState, hook: str | None, options: Mapping[str, Any] | None) -> None:
    """Refuse a hook faccel does not know, options it would not use, or a strategy without DDP.

    Example:
        >>> import faccel
        >>> check_comm_hook(faccel.DistState(), "fp16", None)
        >>> check_comm_hook(faccel.DistState(), "fp8", None)
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: comm_hook must be one of ...
    """
    if hook is None:
        if options:
            msg = "comm_hook_options without comm_hook: pass comm_hook='powersgd' (or another) with them"
            raise ArgumentValueError(msg)
        return
    if hook not in COMM_HOOKS:
        msg = f"comm_hook must be one of {COMM_HOOKS} or None, got {hook!r}"
        raise ArgumentValueError(msg)
    allowed = (*_POWERSGD_KEYS, "wrapper") if hook.endswith("powersgd") else ()
    unknown = sorted(set(options or {}) - set(allowed))
    if unknown:
        msg = (
            f"comm_hook_options {unknown} do not apply to comm_hook={hook!r}; it takes "
            f"{list(allowed) or 'none'} (PowerSGDState's keywords, and wrapper='fp16' or 'bf16')"
        )
        raise ArgumentValueError(msg)
    wrapper = (options or {}).get("wrapper")
    if wrapper is not None and wrapper not in _WRAPPERS:
        msg = f"comm_hook_options['wrapper'] must be 'fp16', 'bf16' or None, got {wrapper!r}"
        raise ArgumentValueError(msg)
    if dist.strategy != "ddp":
        msg = (
            f"comm_hook={hook!r} is a DistributedDataParallel hook, and strategy={dist.strategy!r} does "
            "not wrap the model in DDP (FSDP2 reduces its shards itself, DeepSpeed has its own "
            "communication settings); drop comm_hook, or use strategy='ddp'"
        )
        raise PrepareError(msg)
    if "bf16" in (hook, wrapper) and dist.world_size > 1 and dist.backend != "nccl":
        msg = (
            f"comm_hook bf16 on backend {dist.backend!r}: torch's bf16 compression hook needs NCCL "
            "(CUDA 11+, NCCL 2.10+); use comm_hook='fp16' on gloo"
        )
        raise PrepareError(msg)


def register_comm_hook(model: nn.Module, hook: str, options: Mapping[str, Any] | None) -> None:
    """Register ``hook`` on ``model`` when it is a ``DistributedDataParallel`` wrapper (else nothing)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return  # one process: no gradients are communicated
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        return
    if hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return
    settings = dict(options or {})
    wrapper = settings.pop("wrapper", None)
    state = powerSGD_hook.PowerSGDState(process_group=None, **settings)
    function: Callable[..., Any] = (
        powerSGD_hook.powerSGD_hook if hook == "powersgd" else powerSGD_hook.batched_powerSGD_hook
    )
    if wrapper == "fp16":
        function = default_hooks.fp16_compress_wrapper(function)
    elif wrapper == "bf16":
        function = default_hooks.bf16_compress_wrapper(function)
    model.register_comm_hook(state, function)
