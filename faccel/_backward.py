"""``backward``: the loss's backward pass, with the scaling precision and accumulation need."""

from __future__ import annotations

from typing import Any

import torch

from faccel._state import DistState

__all__ = ["backward"]


def backward(dist: DistState, loss: torch.Tensor, **kwargs: Any) -> None:
    """Run the backward pass of ``loss`` as ``dist`` requires.

    Under DDP the gradients are averaged across ranks during this call (DDP's
    own hooks); in one process it is ``loss.backward()``.

    Args:
        dist: The run's :class:`DistState`.
        loss: A scalar tensor.
        **kwargs: Passed to ``torch.Tensor.backward`` (``retain_graph``...).

    Example:
        >>> import torch, faccel
        >>> w = torch.ones(2, requires_grad=True)
        >>> faccel.backward(faccel.detect({}), (w * 3).sum())
        >>> w.grad.tolist()
        [3.0, 3.0]
    """
    loss.backward(**kwargs)
