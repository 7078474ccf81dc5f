"""DTensors, the one place faccel asks about them: is it one, which box of the whole tensor is this rank's.

Looked up in ``sys.modules``, not imported: importing ``torch.distributed.tensor``
costs seconds, and without that import no DTensor exists.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["copy_box", "is_dtensor", "local_box"]


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor (looked up, not imported: without the import none exists).

    Example:
        >>> import torch
        >>> is_dtensor(torch.zeros(2))
        False
    """
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(tensor, dtensor.DTensor)


def local_box(tensor: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(offset, shape)`` of this rank's part of the DTensor ``tensor`` in the whole tensor.

    torch's own ``compute_local_shape_and_global_offset`` (private, the one use
    in faccel; tests/distributed/test_meta_build.py checks it per layout).
    """
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return tuple(offset), tuple(shape)


def copy_box(whole: torch.Tensor, target: Any) -> None:
    """Copy into ``target`` its part of ``whole``: this rank's box of a DTensor, else all of it.

    Example:
        >>> import torch
        >>> out = torch.zeros(2)
        >>> copy_box(torch.ones(2), out)
        >>> out.tolist()
        [1.0, 1.0]
    """
    if not is_dtensor(target):
        target.copy_(whole)
        return
    offset, shape = local_box(target)
    box = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    target.to_local().copy_(whole[box])
