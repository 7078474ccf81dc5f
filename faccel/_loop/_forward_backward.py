"""``forward_backward``: a training step's forward and backward, for any layout.

A strategy that owns forward and backward together (pipeline stages: a schedule) runs the step
its own way; for every other model it is the forward, then :func:`faccel.backward`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from faccel._dist._state import DistState
from faccel._loop._backward import backward
from faccel._loop._micro_step import MicroStep
from faccel._loop._strategies import holding

__all__ = ["forward_backward"]


def forward_backward(
    dist: DistState,
    model: nn.Module,
    loss_fn: Callable[..., torch.Tensor],
    inputs: Any,
    targets: Any,
    *,
    micro: MicroStep | None = None,
    items: int | None = None,
    scaler: torch.amp.GradScaler | None = None,
) -> torch.Tensor:
    """A training step's forward and backward, for any layout; the loss (detached), on every rank.

    For a model that is not pipelined (one process, DDP, FSDP2, tensor
    parallelism) it is exactly::

        loss = loss_fn(model(*inputs), targets)
        faccel.backward(dist, loss, micro=micro, items=items, scaler=scaler)

    For a :class:`PipelinedModel` (``prepare(..., split=...)`` under a layout
    with ``pipeline > 1``) it is the schedule's step: the batch is split into
    ``schedule.microbatches`` micro-batches along dim 0, each runs through the
    stages, its loss ``loss_fn(output, target)`` is scaled as ``backward``
    would scale the batch's (the mean over micro-batches, over the
    accumulation group; or, with ``items=``, a sum over the group's items), and
    its backward runs where the schedule puts it. The loss returned is the
    batch's, as the plain call returns it (the mean of the micro-batch means;
    with ``items=``, their sum), sent from the last stage to every rank.
    So one loop runs unchanged at every layout.

    Args:
        dist: The run's :class:`DistState`.
        model: A prepared model.
        loss_fn: ``loss_fn(output, targets) -> scalar``: a mean over the batch
            (or, with ``items=``, the sum over its items).
        inputs: The model's input: a tensor or a tuple of positional arguments.
        targets: What ``loss_fn`` compares the output with.
        micro: The :class:`MicroStep` under gradient accumulation.
        items: This batch's item count when ``loss_fn`` returns a sum (see ``backward``).
        scaler: The fp16 gradient scaler (not under a pipeline).

    Returns:
        The loss of this batch, detached: the same value on every rank of a pipeline.

    Raises:
        UsageError: Accumulation without ``micro``, or ``items`` without a counted micro-step.
        PrecisionError: fp16 under a pipeline (its loss scale would have to agree across stages).

    Example:
        >>> import torch, faccel
        >>> dist = faccel.detect({})
        >>> model = faccel.prepare(dist, torch.nn.Linear(2, 1, bias=False))
        >>> torch.nn.init.ones_(model.weight)
        Parameter containing:
        tensor([[1., 1.]], requires_grad=True)
        >>> x, y = torch.ones(4, 2), torch.zeros(4, 1)
        >>> loss = faccel.forward_backward(dist, model, torch.nn.functional.mse_loss, x, y)
        >>> loss.item(), model.weight.grad.tolist()  # d/dw mean((2 - 0)^2) = 2 * 2 * 1
        (4.0, [[4.0, 4.0]])
    """
    args = inputs if isinstance(inputs, tuple) else (inputs,)
    loss = holding(model).forward_backward(
        dist, model, loss_fn, args, targets, micro=micro, items=items, scaler=scaler
    )
    if loss is not None:
        return loss
    loss = loss_fn(model(*args), targets)
    backward(dist, loss, micro=micro, items=items, scaler=scaler)
    return loss.detach()
