"""A barrier that carries news: every rank learns whether any rank failed.

A plain barrier after file work hangs the healthy ranks when one rank raised
before reaching it (a full disk on rank 0, a corrupt file seen by rank 1).
Here each rank runs its part, catches its own error, and all ranks meet in
one ``all_reduce`` of a small integer tensor; then every rank raises if any
failed. The same collective is the barrier. Tensors, not
``broadcast_object_list``, because that one pickles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as tdist

from faccel._process_group import comm_device, require_group
from faccel._state import DistState

__all__ = ["agree_max", "together"]

T = TypeVar("T")


def _all_reduce(
    dist: DistState, values: Sequence[int], op: tdist.ReduceOp.RedOpType, *, name: str
) -> list[int]:
    if not dist.distributed:
        return list(values)
    require_group(dist, name)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=comm_device(dist))
    tdist.all_reduce(tensor, op=op)
    return [int(v) for v in tensor.tolist()]


def agree_max(dist: DistState, values: Sequence[int]) -> list[int]:
    """Element-wise maximum of ``values`` over all ranks (the values themselves in one process)."""
    return _all_reduce(dist, values, tdist.ReduceOp.MAX, name="agree_max")


def together(dist: DistState, work: Callable[[], T], *, what: str, raises: type[Exception]) -> T:
    """Run ``work`` on this rank, then wait for all ranks; raise if any rank failed.

    The rank that failed re-raises its own error (an ``OSError`` as a
    ``raises`` naming ``what``); the others raise ``raises`` saying how many
    ranks failed at ``what``. ``raises`` is the caller's class (a checkpoint's
    failure is a ``CheckpointError``, ``save_model``'s a ``StorageError``).
    """
    try:
        result = work()
    except Exception as error:
        _all_reduce(dist, [1], tdist.ReduceOp.SUM, name="together")
        if isinstance(error, OSError):  # a full disk, a permission: say what was being done
            msg = f"{what} failed on rank {dist.rank}: {error}"
            raise raises(msg) from error
        raise
    (failures,) = _all_reduce(dist, [0], tdist.ReduceOp.SUM, name="together")
    if failures:
        msg = (
            f"{what} failed on {failures} other rank(s) of {dist.world_size}; that rank's error "
            "says why. Nothing was committed or loaded on this rank"
        )
        raise raises(msg)
    return result
