"""``sync_grads``: average a gradient pytree across ranks in a few flat buckets per dtype.

Functional code (``torch.func``, ``functional_call``) bypasses DDP's gradient
hooks, so nothing averages its gradients. One ``all_reduce`` per tensor pays
the collective's latency once per tensor (DESIGN.md measured ~30x slower on
gloo than one flat buffer); here the tensors of each dtype and device are
copied into flat buckets of at most 4 MB (or one per dtype), each reduced with
one asynchronous ``all_reduce`` while the next is copied, and handed back as
views of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist

from faccel._pytree import flatten, unflatten
from faccel._state import DistState
from faccel.errors import DistributedError, FunctionalError

__all__ = ["sync_grads"]


def _buckets(leaves: list[Any], cap_bytes: float | None) -> list[list[int]]:
    """Indices of the tensor leaves, grouped by (dtype, device), then cut at ``cap_bytes``."""
    groups: dict[tuple[torch.dtype, torch.device], list[list[int]]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for i, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        if not (leaf.is_floating_point() or leaf.is_complex()):
            msg = (
                f"sync_grads() averages floating-point gradients, but leaf {i} is a {leaf.dtype} tensor; "
                "leave integer tensors (counters, indices) out of the tree"
            )
            raise FunctionalError(msg)
        key = (leaf.dtype, leaf.device)
        nbytes = leaf.numel() * leaf.element_size()
        buckets = groups.setdefault(key, [[]])
        if cap_bytes is not None and buckets[-1] and sizes[key] + nbytes > cap_bytes:
            buckets.append([])
            sizes[key] = 0
        buckets[-1].append(i)
        sizes[key] = sizes.get(key, 0) + nbytes
    return [bucket for buckets in groups.values() for bucket in buckets]


def sync_grads(dist: DistState, grads: Any, *, bucket_cap_mb: float | None = 4.0) -> Any:
    """Average the gradient tree ``grads`` over all ranks; returns the averaged tree.

    What DDP does for ``loss.backward()``, for gradients computed functionally
    (:func:`loss_and_grad`, ``torch.func.grad``). The tensors of each dtype and
    device are copied into flat buckets, divided by the world size, summed
    with one ``all_reduce`` per bucket and returned as views of the buckets;
    ``grads`` is not modified. Non-tensor leaves (``None``) pass through. Every rank must
    call it with trees of the same structure, shapes and dtypes.

    In a world of one process this is the identity: ``grads`` itself comes
    back, and no process group is needed.

    Args:
        dist: The run's :class:`DistState`.
        grads: A pytree of gradient tensors (dicts, lists, tuples, registered records).
        bucket_cap_mb: Cut each dtype's buffer into buckets of at most this many
            megabytes (a larger tensor gets a bucket of its own); they are
            reduced concurrently, so copying one bucket overlaps reducing the
            previous (13 MB over 2 gloo ranks: 1.35x a bare all_reduce with
            4 MB buckets, 1.7x as one bucket). None: one bucket per dtype and device.

    Returns:
        A tree of the same structure holding the averaged gradients.

    Raises:
        DistributedError: ``dist`` is simulated with more than one rank (there
            are no peers to average with), or no process group is running.
        FunctionalError: ``bucket_cap_mb`` is not positive, or the tree holds
            an integer tensor (an average of it is no integer).

    Example:
        >>> import torch, faccel
        >>> grads = {"w": torch.ones(2)}
        >>> faccel.sync_grads(faccel.detect({}), grads) is grads   # one process
        True
    """
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        msg = f"bucket_cap_mb must be > 0 or None, got {bucket_cap_mb!r}"
        raise FunctionalError(msg)
    if dist.world_size == 1:
        return grads
    if not dist.distributed:
        msg = (
            f"sync_grads() averages over real peer processes, but this DistState is "
            f"{dist.launcher} with world_size={dist.world_size} and no process group; "
            "run under a launcher (torchrun) and make the state with faccel.detect()"
        )
        raise DistributedError(msg)
    if not tdist.is_initialized():
        msg = (
            f"sync_grads() on rank {dist.rank} of {dist.world_size} needs a running process group; "
            "make the DistState with faccel.detect(), which starts it"
        )
        raise DistributedError(msg)
    leaves, structure = flatten(grads)
    cap = None if bucket_cap_mb is None else bucket_cap_mb * 2**20
    out = list(leaves)
    with torch.no_grad():
        works = _reduce_buckets(dist, leaves, out, cap)
    for work in works:
        work.wait()
    return unflatten(out, structure)


def _reduce_buckets(dist: DistState, leaves: list[Any], out: list[Any], cap: float | None) -> list[Any]:
    """Start one async all_reduce per bucket; put each leaf's view of its bucket in ``out``."""
    works = []
    for bucket in _buckets(leaves, cap):
        # One fused cat kernel: measured 4x faster than as_strided views + _foreach_copy_
        # for 100 tensors of 0.8 MB, and ~25% faster at 13 MB.
        flat = torch.cat([leaves[i].reshape(-1) for i in bucket])
        # Divide first, as DDP's default hook does: same rounding, no fp16 overflow.
        flat.div_(dist.world_size)
        works.append(tdist.all_reduce(flat, async_op=True))
        pieces = flat.split([leaves[i].numel() for i in bucket])
        for i, piece in zip(bucket, pieces, strict=True):
            out[i] = piece.view(leaves[i].shape)
    return works
