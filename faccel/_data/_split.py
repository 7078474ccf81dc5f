"""Spreading a list of work items over the ranks: a pure function of (rank, world size, items)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from faccel._dist._state import DistState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentError, ArgumentValueError

__all__ = ["split_between_processes", "split_bounds"]


def split_bounds(length: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous share of ``length`` items. Pure.

    The first ``length % world_size`` ranks get one item more than the others.

    Example:
        >>> [split_bounds(7, rank, 3) for rank in range(3)]
        [(0, 3), (3, 5), (5, 7)]
    """
    base, extra = divmod(length, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


def _length(items: Any, name: str) -> int:
    if isinstance(items, torch.Tensor):
        if items.ndim == 0:
            msg = f"{name} is a 0-d tensor, which has no items to split; pass a tensor with a dim 0"
            raise ArgumentError(msg)
        return items.shape[0]
    if isinstance(items, (str, bytes)):
        msg = (
            f"{name} is a {type(items).__name__}, which would be split character by character; "
            "pass a list of strings"
        )
        raise ArgumentError(msg)
    if not isinstance(items, Sequence):
        msg = f"{name} must be a list, tuple, tensor or other sequence, got {type(items).__qualname__}"
        raise ArgumentError(msg)
    return len(items)


def _split_one(items: Any, start: int, end: int, missing: int) -> Any:
    part = items[start:end]
    if not missing:
        return part
    if isinstance(items, torch.Tensor):
        return torch.cat([part, items[-1:].expand(missing, *items.shape[1:])])
    padding = [items[-1]] * missing
    return (*part, *padding) if isinstance(items, tuple) else [*part, *padding]


@setup_checked
def split_between_processes(
    dist: DistState,
    items: Sequence[Any] | torch.Tensor | Mapping[Any, Any],
    *,
    pad: bool = False,
) -> Any:
    """This rank's contiguous share of ``items``, for spreading inference work. Pure.

    Rank ``r`` gets the ``r``-th of ``world_size`` contiguous slices, the first
    ``len(items) % world_size`` ranks one item more; concatenated in rank order
    the slices are ``items``. A dict's values (lists, tuples or tensors of equal
    length, e.g. ``{"prompt": [...], "id": [...]}``) are split alike. Works with
    a simulated ``DistState`` too: it reads only the rank and world size.
    Under a layout with tensor parallelism the shares go to the data-parallel
    ranks (``dist.data_rank`` of ``dist.data_world_size``): the ranks of one
    tensor-parallel group compute each forward together, so they get one share.

    Args:
        dist: This process's state.
        items: A list, tuple, tensor (split along dim 0), other sequence, or a
            mapping of them.
        pad: Make every rank's share the same length by repeating the last item
            of ``items`` (so that a later :func:`faccel.gather` lines up; drop the
            repeats afterwards). A padded share of an ``items`` that is neither
            a tuple nor a tensor is a list.

    Returns:
        The share, of the type of ``items`` (a slice: a tensor share is a view
        unless padded).

    Raises:
        ArgumentError: ``items`` (or a dict value) is a string, a 0-d tensor or not a sequence.
        ArgumentValueError: A dict's values have different lengths.

    Example:
        >>> import faccel
        >>> prompts = ["a", "b", "c", "d", "e"]
        >>> [split_between_processes(faccel.DistState.simulated(rank=r, world_size=2), prompts)
        ...  for r in range(2)]
        [['a', 'b', 'c'], ['d', 'e']]
        >>> split_between_processes(faccel.DistState.simulated(rank=1, world_size=2), prompts, pad=True)
        ['d', 'e', 'e']
        >>> layout = faccel.Layout(shard=2, tensor=2)   # ranks 2 and 3: data-parallel rank 1
        >>> [split_between_processes(faccel.DistState.simulated(rank=r, world_size=4, layout=layout), prompts)
        ...  for r in range(4)]
        [['a', 'b', 'c'], ['a', 'b', 'c'], ['d', 'e'], ['d', 'e']]
    """
    named = dict(items) if isinstance(items, Mapping) else {None: items}
    lengths = {
        key: _length(value, "items" if key is None else f"items[{key!r}]") for key, value in named.items()
    }
    if len(set(lengths.values())) > 1:
        msg = (
            f"the values of a dict are split alike, so they need one length, got {lengths}; "
            "split them separately or make them equally long"
        )
        raise ArgumentValueError(msg)
    length = next(iter(lengths.values()), 0)
    # Over the data-parallel ranks: a tensor-parallel group runs each forward together, on one share.
    start, end = split_bounds(length, dist.data_rank, dist.data_world_size)
    # Pad to the longest share, ceil(length / world), with the last item (none if there is none).
    missing = -(-length // dist.data_world_size) - (end - start) if pad and length else 0
    split = {key: _split_one(value, start, end, missing) for key, value in named.items()}
    if not isinstance(items, Mapping):
        return split[None]
    return split if type(items) is dict else type(items)(split)  # type: ignore[call-arg]
