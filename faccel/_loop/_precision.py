"""Mixed precision: autocast outside the model, the fp16 gradient scaler, and the optimizer step.

Forward passes of prepared models already run under autocast (``_model.Autocast``).
fp16 also needs loss scaling: :func:`grad_scaler` makes the scaler (a live
``torch.amp.GradScaler`` whose state belongs in ``TrainState``), ``backward``
scales the loss with it, and :func:`optimizer_step` unscales, skips the step on
inf/NaN gradients and *returns* whether it stepped, so nothing is a hidden flag.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from faccel._dist._state import DistState
from faccel._loop._schedule import advance_scheduler
from faccel._typecheck import setup_checked

__all__ = ["autocast", "grad_scaler", "optimizer_step"]


def autocast(dist: DistState) -> contextlib.AbstractContextManager[Any]:
    """A context that runs the block under ``dist``'s precision (a no-op for ``'no'``).

    Prepared models already run their forward under autocast; use this for
    computation outside the model, such as a loss written by hand.

    Example:
        >>> import torch, faccel
        >>> dist = faccel.DistState(precision="bf16")
        >>> with faccel.autocast(dist):
        ...     y = torch.nn.functional.linear(torch.ones(1, 2), torch.ones(3, 2))
        >>> y.dtype
        torch.bfloat16
    """
    dtype = dist.autocast_dtype
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(dist.device.type, dtype=dtype)


@setup_checked
def grad_scaler(dist: DistState, **kwargs: Any) -> torch.amp.GradScaler:
    """A gradient scaler for ``dist``: active under ``'fp16'``, a pass-through otherwise.

    A disabled scaler leaves losses and steps untouched, so a loop written with
    a scaler runs unchanged in every precision. Keep it in your ``TrainState``
    so its scale is checkpointed.

    Args:
        dist: The run's :class:`DistState`.
        **kwargs: ``init_scale``, ``growth_factor``... for ``torch.amp.GradScaler``.

    Example:
        >>> import faccel
        >>> faccel.grad_scaler(faccel.DistState(precision="fp16")).is_enabled()
        True
        >>> faccel.grad_scaler(faccel.DistState(precision="bf16")).is_enabled()
        False
    """
    return torch.amp.GradScaler(dist.device.type, enabled=dist.precision == "fp16", **kwargs)


def optimizer_step(
    dist: DistState,
    optimizer: torch.optim.Optimizer,
    *,
    scaler: torch.amp.GradScaler | None = None,
    scheduler: Any = None,
    scheduler_steps: int = 1,
) -> bool:
    """Step ``optimizer`` (through ``scaler`` if given), then ``scheduler`` if it stepped.

    With an active scaler, gradients are unscaled (unless ``clip_grad_norm``
    already did), the step is skipped when any gradient is inf or NaN, and the
    scale is updated. A skipped step does not advance the scheduler.

    Args:
        dist: The run's :class:`DistState`.
        optimizer: The optimizer to step.
        scaler: The fp16 gradient scaler, or None.
        scheduler: An LR scheduler to advance after a real step, or None.
        scheduler_steps: How many times to advance it per real step: 1
            (faccel's rule), or ``faccel.accelerate_scheduler_steps(dist)`` to
            keep a ported Accelerate script's schedule exactly (a
            ``OneCycleLR`` stops at its last step, as there).

    Returns:
        True when the optimizer stepped; False when the scaler skipped the step.

    Example:
        >>> import torch, faccel
        >>> dist = faccel.DistState()
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=0.5)
        >>> faccel.backward(dist, (2 * w).sum())
        >>> faccel.optimizer_step(dist, opt), w.item()
        (True, 0.0)
    """
    dist.runtime.phase = "optimizer"  # what a hang record says this rank is doing
    if scaler is None or not scaler.is_enabled():
        optimizer.step()
        stepped = True
    else:
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        # update() backs the scale off exactly when it found inf/NaN gradients.
        stepped = scaler.get_scale() >= before
    if stepped and scheduler is not None:
        if scheduler_steps == 1:
            scheduler.step()
        else:
            advance_scheduler(scheduler, scheduler_steps)
    return stepped
