"""Gradient accumulation, with the boundary as a pure function of plain integers.

Micro-step ``i`` of an epoch with ``n`` batches and ``k`` accumulation steps
belongs to group ``i // k``; the group syncs (all-reduces and steps) at its
last micro-step, and its losses are divided by the group's real size, so the
last, partial group of an epoch is weighted correctly. No counter is kept
anywhere: :func:`micro_batches` derives each :class:`MicroStep` from the
loader's position.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._data._loader import PreparedLoader
from faccel._dist._state import DistState
from faccel._loop._model import is_sharded
from faccel._typecheck import setup_checked
from faccel.errors import AccumulationError, ArgumentError

__all__ = ["MicroStep", "accumulate", "micro_batches", "micro_step", "steps_per_epoch"]

# nullcontext keeps no state, so one instance serves every `with` (in the hot loop).
_NOTHING = contextlib.nullcontext()


class MicroStep(NamedTuple):
    """Where a micro-batch sits in its accumulation group.

    A named tuple rather than an attrs record: one is made per micro-batch in
    the training loop, and a frozen attrs instance measured ~1.5% of a small
    model's micro-step (a named tuple: within noise of none).

    Attributes:
        index: The micro-step's index in the epoch (batches consumed before it).
        sync: Whether this micro-step ends its group: gradients are all-reduced
            and the optimizer steps after it.
        group_size: Micro-steps in this group (its losses are divided by it).

    Example:
        >>> micro_step(9, accumulation_steps=4, num_batches=10)
        MicroStep(index=9, sync=True, group_size=2)
    """

    # Shadows tuple.index (a method nobody calls on a MicroStep): the name reads best.
    index: int  # type: ignore[assignment]
    sync: bool
    group_size: int


def micro_step(index: int, *, accumulation_steps: int, num_batches: int | None) -> MicroStep:
    """The :class:`MicroStep` of micro-batch ``index``. Pure.

    Args:
        index: Batches consumed in the epoch before this one.
        accumulation_steps: Micro-batches per optimizer step.
        num_batches: Batches in the epoch; None when unknown (then every group
            is taken as full and the caller must say when the data ends).

    Raises:
        AccumulationError: ``index`` outside ``[0, num_batches)`` or steps < 1.

    Example:
        >>> [micro_step(i, accumulation_steps=2, num_batches=5).sync for i in range(5)]
        [False, True, False, True, True]
    """
    if accumulation_steps < 1:
        msg = f"accumulation_steps must be >= 1, got {accumulation_steps!r}"
        raise AccumulationError(msg)
    if index < 0 or (num_batches is not None and index >= num_batches):
        msg = f"micro-step index must be in [0, {num_batches}), got {index!r}"
        raise AccumulationError(msg)
    return _micro(index, accumulation_steps, num_batches)


def _micro(index: int, k: int, num_batches: int | None) -> MicroStep:
    # The boundary itself, for arguments already known to be valid (the hot loop).
    first = index - index % k
    end = first + k if num_batches is None else min(first + k, num_batches)
    return MicroStep(index=index, sync=index == end - 1, group_size=end - first)


def _groups(iterable: Iterable[Any], size: int, first: int) -> Iterator[list[Any]]:
    iterator = iter(iterable)
    while group := list(itertools.islice(iterator, first)):
        yield group
        first = size


def micro_batches(dist: DistState, loader: Iterable[Any]) -> Iterator[tuple[MicroStep, Any]]:
    """Pair each batch of ``loader`` with its :class:`MicroStep` under ``dist.accumulation_steps``.

    Indices count from ``loader.start`` for a resumed :class:`PreparedLoader`.
    For a loader without a length, each group's batches are read before the
    group starts, so the size of the final, partial group is known and its
    losses are scaled right.

    Example:
        >>> import faccel
        >>> dist = faccel.DistState(accumulation_steps=2)
        >>> [(m.index, m.sync, m.group_size) for m, _ in faccel.micro_batches(dist, "abc")]
        [(0, False, 2), (1, True, 2), (2, True, 1)]
    """
    k = dist.accumulation_steps
    start = getattr(loader, "start", 0)
    try:
        total: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    if total is not None:
        for offset, batch in enumerate(loader):
            yield _micro(start + offset, k, total), batch
        return
    # Groups stay aligned to the epoch (index // k) when resuming mid-epoch.
    index = start
    for group in _groups(loader, k, k - start % k):
        size = index % k + len(group)
        for position, batch in enumerate(group):
            micro = MicroStep(index=index, sync=position == len(group) - 1, group_size=size)
            yield micro, batch
            index += 1


@setup_checked
def steps_per_epoch(dist: DistState, loader: Iterable[Any]) -> int:
    """Optimizer steps this rank takes in one epoch of the prepared ``loader``.

    Its batches (``len(loader)``, this rank's shard) over ``dist.accumulation_steps``,
    rounded up: the last, partial group of an epoch steps too (see :func:`micro_step`).
    Size a schedule with it after :func:`faccel.prepare`, e.g.
    ``OneCycleLR(optimizer, max_lr, total_steps=epochs * steps_per_epoch(dist, loader))``:
    ``len()`` of the ``DataLoader`` before ``prepare`` counts every rank's batches,
    so a schedule sized from it would end only partly annealed on several processes.

    Raises:
        ArgumentError: ``loader`` is not the :class:`PreparedLoader` that
            ``prepare`` returned (e.g. the ``DataLoader`` given to it), it reads
            an ``IterableDataset`` without ``__len__`` (its length is unknown), or
            ``dist`` is not a ``DistState``.

    Example:
        >>> import torch, faccel
        >>> data = torch.utils.data.TensorDataset(torch.arange(64.0))
        >>> raw = torch.utils.data.DataLoader(data, batch_size=4)
        >>> dist = faccel.DistState.simulated(rank=0, world_size=2, accumulation_steps=3)
        >>> loader = faccel.prepare(dist, raw)
        >>> len(raw), len(loader), faccel.steps_per_epoch(dist, loader)
        (16, 8, 3)
    """
    if not isinstance(loader, PreparedLoader):
        msg = (
            f"steps_per_epoch needs the loader that faccel.prepare returned, got {type(loader).__name__}: "
            "before prepare, a DataLoader's len() counts the batches of every rank; "
            "call it with the prepared loader (and build the scheduler after prepare)"
        )
        raise ArgumentError(msg)
    return -(-len(loader) // dist.accumulation_steps)


def accumulate(dist: DistState, model: nn.Module, micro: MicroStep) -> contextlib.AbstractContextManager[Any]:
    """A context for the forward and backward of ``micro``: DDP's ``no_sync`` unless it syncs.

    Gradients of non-syncing micro-steps stay local (no all-reduce); the
    syncing micro-step all-reduces the accumulated sum once. FSDP2 models get
    ``set_requires_gradient_sync(False)`` for the block instead.

    Example:
        >>> import torch, faccel
        >>> dist = faccel.DistState(accumulation_steps=2)
        >>> model = torch.nn.Linear(2, 1)
        >>> for micro, x in faccel.micro_batches(dist, [torch.ones(1, 2)] * 2):
        ...     with faccel.accumulate(dist, model, micro):
        ...         faccel.backward(dist, model(x).sum(), micro=micro)
        >>> model.bias.grad.item()
        1.0
    """
    if micro.sync or not dist.distributed:
        return _NOTHING  # one process: there is no all-reduce to skip
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if is_sharded(model) and hasattr(type(model), "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    # Tensor parallelism alone reduces inside each forward and backward: nothing to defer.
    return _NOTHING


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    # FSDP2's switch: gradients stay unsharded and un-reduced until a syncing backward.
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]
