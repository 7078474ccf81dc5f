"""DDP communication hooks through ``prepare``: fp16, bf16 and PowerSGD gradient compression.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=..., comm_wrapper=...,
comm_state_option=...)`` as ``prepare(..., comm_hook=..., comm_hook_options=...)``.
The hooks are torch's own (``torch.distributed.algorithms.ddp_comm_hooks``),
registered on the ``DistributedDataParallel`` wrapper ``prepare`` returns; a
PowerSGD hook's state (its error feedback and iteration count) is torch's, held
by that wrapper. In one process there is no gradient communication and no
wrapper: the option is accepted and does nothing, so one script runs at any
size. Under FSDP2 or DeepSpeed (no DDP wrapper) it is refused by name.

Every option is checked at ``prepare`` (a rank of 0 would freeze the weight
matrices, a NaN epsilon make them NaN), and the options are part of
``prepare``'s set-up check, so ranks given different ones are refused there.
torch cannot take a comm hook off a DDP wrapper: :func:`faccel.shutdown`
drops the PowerSGD state's buffers (its error feedback and warm-start
matrices), found through the wrapper's mark ``_faccel_comm_hook``
(``faccel._marks.COMM_HOOK``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any, get_args

from torch import nn

from faccel._choices import CommHookName
from faccel._dist._state import DistState
from faccel._marks import COMM_HOOK
from faccel._torch_compat import batched_powersgd_works
from faccel.errors import ArgumentError, ArgumentValueError, PrepareError

__all__ = ["COMM_HOOKS", "CommHook", "check_comm_hook", "register_comm_hook"]

CommHook = CommHookName
COMM_HOOKS: tuple[str, ...] = get_args(CommHookName)
# Each hook: its function's name in torch's ddp_comm_hooks, and whether it is a PowerSGD one (which
# takes PowerSGDState's keywords and a compression wrapper).
_HOOKS: Mapping[str, tuple[str, bool]] = {
    "fp16": ("fp16_compress_hook", False),
    "bf16": ("bf16_compress_hook", False),
    "powersgd": ("powerSGD_hook", True),
    "batched_powersgd": ("batched_powerSGD_hook", True),
}
# The compression wrapped around PowerSGD (comm_hook_options["wrapper"]): default_hooks' function.
_WRAPPERS: Mapping[str, str] = {"fp16": "fp16_compress_wrapper", "bf16": "bf16_compress_wrapper"}
_BOOL = "True or False"
# PowerSGDState's keywords comm_hook_options may hold: what each takes, and its check.
_POWERSGD: Mapping[str, tuple[str, Callable[[Any], bool]]] = {
    # 0 leaves the compressed gradient empty: the weight matrices would never change.
    "matrix_approximation_rank": ("an int >= 1", lambda v: type(v) is int and v >= 1),
    "start_powerSGD_iter": ("an int >= 1", lambda v: type(v) is int and v >= 1),
    "min_compression_rate": (
        "a finite number > 0",
        lambda v: type(v) in (int, float) and math.isfinite(v) and v > 0,
    ),
    "use_error_feedback": (_BOOL, lambda v: type(v) is bool),
    "warm_start": (_BOOL, lambda v: type(v) is bool),
    # NaN or infinity would be added to every norm: NaN weights.
    "orthogonalization_epsilon": (
        "a finite number >= 0",
        lambda v: type(v) in (int, float) and math.isfinite(v) and v >= 0,
    ),
    # numpy's RandomState takes seeds of 32 bits.
    "random_seed": ("an int from 0 to 2**32 - 1", lambda v: type(v) is int and 0 <= v < 2**32),
}


def check_comm_hook(dist: DistState, hook: str | None, options: Mapping[str, Any] | None) -> None:
    """Refuse a hook faccel does not know, options it would not (or could not) use, or a strategy without DDP.

    Example:
        >>> import faccel
        >>> check_comm_hook(faccel.DistState(), "fp16", None)
        >>> check_comm_hook(faccel.DistState(), "fp8", None)
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: comm_hook must be one of ...
    """
    if options is not None and not isinstance(options, Mapping):
        msg = f"comm_hook_options must be a dict of PowerSGDState's keywords, got {type(options).__name__}"
        raise ArgumentError(msg)
    if hook is None:
        if options:
            msg = "comm_hook_options without comm_hook: pass comm_hook='powersgd' (or another) with them"
            raise ArgumentValueError(msg)
        return
    if hook not in _HOOKS:
        msg = f"comm_hook must be one of {COMM_HOOKS} or None, got {hook!r}"
        raise ArgumentValueError(msg)
    _, powersgd = _HOOKS[hook]
    settings = dict(options or {})
    allowed = (*_POWERSGD, "wrapper") if powersgd else ()
    unknown = sorted(str(key) for key in set(settings) - set(allowed))
    if unknown:
        msg = (
            f"comm_hook_options {unknown} do not apply to comm_hook={hook!r}; it takes "
            f"{list(allowed) or 'none'} (PowerSGDState's keywords, and wrapper='fp16' or 'bf16')"
        )
        raise ArgumentValueError(msg)
    wrapper = settings.get("wrapper")
    if wrapper is not None and wrapper not in _WRAPPERS:
        msg = f"comm_hook_options['wrapper'] must be 'fp16', 'bf16' or None, got {wrapper!r}"
        raise ArgumentValueError(msg)
    if powersgd:
        _check_powersgd(settings)
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
    if hook == "batched_powersgd" and not batched_powersgd_works():
        # Refused at any size, so that a script tried in one process does not fail at scale.
        import torch

        msg = (
            f"comm_hook='batched_powersgd' cannot run on torch {torch.__version__}: its "
            "batched_powerSGD_hook hands 2-D matrices to an orthogonalization that takes 3-D ones, and "
            "fails at the first compressed step (start_powerSGD_iter); use comm_hook='powersgd'"
        )
        raise PrepareError(msg)


def _check_powersgd(settings: Mapping[str, Any]) -> None:
    for key, (expected, valid) in _POWERSGD.items():
        if key in settings and not valid(settings[key]):
            msg = f"comm_hook_options[{key!r}] must be {expected}, got {settings[key]!r}"
            raise ArgumentValueError(msg)
    # PowerSGD keeps its state from the second step on: DDP rebuilds its buckets after the first.
    keeps_state = settings.get("use_error_feedback", True) or settings.get("warm_start", True)
    if keeps_state and settings.get("start_powerSGD_iter", 1000) < 2:
        msg = (
            f"comm_hook_options['start_powerSGD_iter'] is {settings['start_powerSGD_iter']}, and with "
            "use_error_feedback or warm_start (both True unless set False) PowerSGD can begin at step 2 "
            "at the earliest (DDP rebuilds its buckets after the first step); pass 2 or more, or set "
            "both False"
        )
        raise ArgumentValueError(msg)


def register_comm_hook(
    dist: DistState, model: nn.Module, hook: CommHookName, options: Mapping[str, Any] | None
) -> None:
    """Register ``hook`` on ``model`` when it is a ``DistributedDataParallel`` wrapper (else nothing).

    A PowerSGD hook's state is marked on the wrapper (``faccel._marks.COMM_HOOK``), and
    ``dist.runtime`` drops its buffers at :func:`faccel.shutdown`.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return  # one process: no gradients are communicated
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    name, powersgd = _HOOKS[hook]
    if not powersgd:
        model.register_comm_hook(None, getattr(default_hooks, name))
        return
    settings = dict(options or {})
    wrapper = settings.pop("wrapper", None)
    state = powerSGD_hook.PowerSGDState(process_group=None, **settings)
    function: Callable[..., Any] = getattr(powerSGD_hook, name)
    if wrapper is not None:
        function = getattr(default_hooks, _WRAPPERS[wrapper])(function)
    model.register_comm_hook(state, function)
    object.__setattr__(model, COMM_HOOK, state)
    dist.runtime.at_close(f"comm hook state {id(model)}", _dropper(weakref.ref(model)))


def _dropper(wrapper: weakref.ReferenceType[nn.Module]) -> Callable[[], None]:
    """What shutdown runs: empty the PowerSGD state's buffers, if the wrapper still lives."""

    def drop() -> None:
        model = wrapper()
        state = None if model is None else getattr(model, COMM_HOOK, None)
        if state is not None:
            state.error_dict.clear()
            state.p_memory_dict.clear()
            state.q_memory_dict.clear()

    return drop
