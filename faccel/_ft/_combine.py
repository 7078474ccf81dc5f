"""The step's gradient from the replicas' gradients: one fixed order of summation (pure).

Each replica's gradient is the mean over its own samples; the step's is the mean over
all the step's samples: ``sum(count_r * grad_r) / sum(count_r)``, summed in replica-rank
order. With full batches that is the sum of the replicas' gradients divided by the
number that took part. Summing the gathered gradients here, in one order, rather than
in an all-reduce whose order depends on the ring, is what lets a run be replayed in
one process bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["combine", "flat_grads", "set_flat_grads"]


def flat_grads(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters' gradients in one flat tensor (zeros for a parameter without one).

    Example:
        >>> w = torch.nn.Parameter(torch.ones(2))
        >>> (w * 3).sum().backward()
        >>> flat_grads([w, torch.nn.Parameter(torch.ones(1))]).tolist()
        [3.0, 3.0, 0.0]
    """
    parts = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach().reshape(-1) for p in params]
    return torch.cat(parts) if parts else torch.zeros(0)


def set_flat_grads(params: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Each parameter's ``.grad`` set to its slice of ``flat`` (the inverse of :func:`flat_grads`).

    Example:
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> set_flat_grads([w], torch.tensor([1.0, 2.0]))
        >>> w.grad.tolist()
        [1.0, 2.0]
    """
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


def combine(grads: Sequence[torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
    """The mean gradient over all samples: ``sum(counts[r] * grads[r]) / sum(counts)``, in rank order.

    Example:
        >>> combine([torch.tensor([1.0]), torch.tensor([4.0])], [2, 2]).tolist()
        [2.5]
    """
    total = grads[0] * counts[0]
    for grad, count in zip(grads[1:], counts[1:], strict=True):
        total += grad * count
    return total / max(sum(counts), 1)
