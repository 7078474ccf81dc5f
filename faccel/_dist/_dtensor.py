"""Copying a rank's box of a whole tensor into a DTensor (or a plain tensor).

Whether a value is a DTensor, and which box of the whole tensor a rank holds,
are answered by ``faccel._torch_compat`` (``is_dtensor``, ``local_box``), the one place
that asks torch.

Looked up in ``sys.modules``, not imported: importing ``torch.distributed.tensor``
costs seconds, and without that import no DTensor exists.
"""

from __future__ import annotations

from typing import Any

import torch

from faccel._torch_compat import is_dtensor, local_box

__all__ = ["copy_box"]


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
