"""``uneven_inputs``: a training loop in which ranks run different numbers of steps.

With ``prepare(..., even_batches=False)`` nothing is repeated, so ranks may
differ by one batch. Under DDP every backward all-reduces the gradients with
every rank; a rank that ran out of batches would leave the others waiting for
ever. PyTorch's ``Join`` context has the ranks that are done *shadow* the
others' all-reduces with zero gradients, so nobody hangs, and the ranks that
still step keep their gradients.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._dist._state import DistState
from faccel._loop._strategies._deepspeed._engine import is_deepspeed_engine
from faccel.errors import UsageError

__all__ = ["uneven_inputs"]


@contextmanager
def uneven_inputs(
    dist: DistState, model: nn.Module, *, divide_by_initial_world_size: bool = False
) -> Iterator[None]:
    """Let ranks run different numbers of training steps under DDP without hanging.

    Wrap the epoch loop: ``with faccel.uneven_inputs(dist, model): for batch in
    loader: ...``. Each gradient all-reduce then averages over the ranks that
    still have a batch (``divide_by_initial_world_size=False``, the default: the
    last step's gradient is the mean over the ranks present, as if they were the
    whole world), or sums them and divides by the world size (True: the ranks
    that are done count as zero gradients). Only DDP's own collectives are
    shadowed: other collectives inside the loop (``faccel.reduce`` of a loss
    for logging) would still wait for the finished ranks, so do them after it.
    In one process this does nothing.

    Args:
        dist: This process's state.
        model: The model ``faccel.prepare`` returned (a ``DistributedDataParallel``
            when there are peers).
        divide_by_initial_world_size: See above.

    Raises:
        UsageError: There are peers but ``model`` is not the DDP module
            ``prepare`` returned (an FSDP2 model, a DeepSpeed engine, or the unwrapped module), or
            ``dist.accumulation_steps`` > 1 (the ranks would disagree on which
            micro-steps synchronise).

    Example:
        >>> import torch, faccel
        >>> dist = faccel.detect({})
        >>> model = faccel.prepare(dist, torch.nn.Linear(2, 1))
        >>> with uneven_inputs(dist, model):
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> model.weight.grad.tolist()
        [[1.0, 1.0]]
    """
    if dist.accumulation_steps > 1:
        # micro_batches cuts each rank's batches into groups from its own length; with
        # uneven lengths the ranks would disagree on which micro-steps all-reduce.
        msg = (
            f"uneven_inputs cannot be combined with accumulation_steps={dist.accumulation_steps}: "
            "ranks with different numbers of batches would disagree on which micro-steps "
            "synchronise gradients; keep prepare(..., even_batches=True) when accumulating"
        )
        raise UsageError(msg)
    if not dist.distributed:
        yield
        return
    if is_deepspeed_engine(model):
        msg = (
            "uneven_inputs cannot join a DeepSpeed engine (ZeRO's collectives have no Join hook): keep "
            "prepare(..., even_batches=True) under strategy='deepspeed', which gives every rank the same "
            "number of batches"
        )
        raise UsageError(msg)
    if not isinstance(model, DistributedDataParallel):
        msg = (
            f"uneven_inputs needs the DistributedDataParallel model faccel.prepare returned, got a "
            f"{type(model).__name__}; pass the prepared model (FSDP2 models cannot join: keep "
            "even_batches=True with them, which gives every rank the same number of batches)"
        )
        raise UsageError(msg)
    from torch.distributed.algorithms import Join

    with Join([model], divide_by_initial_world_size=divide_by_initial_world_size):
        yield
