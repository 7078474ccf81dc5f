"""An LR scheduler stepped the way a ported Accelerate script stepped it.

faccel advances a scheduler once per optimizer step, whatever the world size
(``optimizer_step(..., scheduler=s)``). Accelerate's prepared scheduler
(``AcceleratedScheduler``) advances ``num_processes`` times per optimizer step
unless the batches are split, so a schedule written for Accelerate
(``num_warmup_steps=100``, ``num_training_steps=len(loader) * epochs`` with the
loader before ``prepare``) runs N times slower under faccel on N processes. To
keep such a script's schedule exactly, step it
``accelerate_scheduler_steps(dist)`` times: a value, not a wrapper with a
counter, passed as ``optimizer_step(..., scheduler_steps=...)``.
"""

from __future__ import annotations

from typing import Any

from faccel._dist._state import DistState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError

__all__ = ["accelerate_scheduler_steps", "advance_scheduler"]


@setup_checked
def accelerate_scheduler_steps(dist: DistState, *, split_batches: bool = False) -> int:
    """How many times Accelerate advances a prepared LR scheduler per optimizer step on ``dist``.

    ``dist.world_size`` (Accelerate's ``num_processes``), or 1 with
    ``split_batches`` (``Accelerator(split_batches=True)``, or
    ``DataLoaderConfiguration(split_batches=True)``). Pass it as
    ``faccel.optimizer_step(dist, optimizer, scheduler=s, scheduler_steps=...)``
    to run a ported script's schedule exactly as under Accelerate
    (docs/from-accelerate.md, first of the semantic differences).

    Args:
        dist: The run's :class:`DistState`.
        split_batches: Whether the Accelerate script split its batches.

    Returns:
        Scheduler steps per optimizer step.

    Example:
        >>> import faccel
        >>> four = faccel.DistState.simulated(rank=0, world_size=4)
        >>> steps = faccel.accelerate_scheduler_steps
        >>> steps(four), steps(four, split_batches=True)
        (4, 1)
    """
    return 1 if split_batches else dist.world_size


def advance_scheduler(scheduler: Any, times: int) -> None:
    """Step ``scheduler`` ``times`` times; one with ``total_steps`` (``OneCycleLR``) stops at its end.

    Accelerate's rule: a ``OneCycleLR`` stepped N times per optimizer step would
    pass its last step (torch raises there), so the steps past it are dropped.

    Example:
        >>> import torch
        >>> w = torch.nn.Parameter(torch.ones(1))
        >>> opt = torch.optim.SGD([w], lr=1.0)
        >>> s = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        >>> opt.step(); advance_scheduler(s, 3); s.get_last_lr()
        [0.125]
    """
    if type(times) is not int or times < 1:
        msg = f"scheduler_steps must be an int >= 1, got {times!r}; see faccel.accelerate_scheduler_steps"
        raise ArgumentValueError(msg)
    total = getattr(scheduler, "total_steps", None)
    for _ in range(times):
        if isinstance(total, int) and scheduler._step_count > total:
            return
        scheduler.step()
