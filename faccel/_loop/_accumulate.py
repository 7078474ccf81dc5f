"""Gradient accumulation in the loop: micro-batches from the loader, and the no-sync contexts.

No counter is kept anywhere: :func:`micro_batches` derives each
:class:`~faccel._loop._micro_step.MicroStep` from the loader's position, by
the pure boundary of ``_micro_step``; :func:`accumulate` skips the gradient
all-reduce (DDP's ``no_sync``, FSDP2's ``set_requires_gradient_sync``) inside
a group.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from faccel._data._loader import PreparedLoader
from faccel._dist._state import DistState
from faccel._loop._exact._mode import ExactRun
from faccel._loop._micro_step import MicroStep
from faccel._loop._model import is_sharded
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentError, ArgumentValueError

__all__ = ["accumulate", "micro_batches", "steps_per_epoch"]

# nullcontext keeps no state, so one instance serves every `with` (in the hot loop).
_NOTHING = contextlib.nullcontext()


def _groups(iterable: Iterable[Any], size: int, first: int) -> Iterator[list[Any]]:
    iterator = iter(iterable)
    while group := list(itertools.islice(iterator, first)):
        yield group
        first = size


def micro_batches(
    dist: DistState,
    loader: Iterable[Any],
    *,
    items: Callable[[Any], int] | None = None,
    atoms: int | None = None,
    model: nn.Module | None = None,
) -> Iterator[tuple[MicroStep, Any]]:
    """Pair each batch of ``loader`` with its :class:`MicroStep` under ``dist.accumulation_steps``.

    Indices count from ``loader.start`` for a resumed :class:`PreparedLoader`.
    For a loader without a length, each group's batches are read before the
    group starts, so the size of the final, partial group is known and its
    losses are scaled right.

    With ``items`` (a function: batch -> its item count, e.g. the tokens whose
    label is not -100), every group's batches are read before the group starts
    and counted; one scalar collective per group sums the counts over the
    data-parallel ranks, and each :class:`MicroStep` carries the total as
    ``items``, for ``faccel.backward(dist, loss_sum, micro=micro, items=n)``.
    Every rank must iterate (the collective), as it must to train anyway.

    With ``atoms=A`` and ``model=`` (exact mode, docs/exact.md), every global
    batch is split into ``A`` equal atoms whatever the number of ranks; each
    yielded micro-step is one atom's share of one batch (``micro.atom``), run
    under torch generators seeded from ``(dist.seed, epoch, position, atom)``,
    and after the step's last ``backward`` every ``.grad`` holds, on every
    rank, the bits one process computes: the same weights at data-parallel
    sizes 1, 2, 4 ... ``A`` and across resumes that change it.

    Args:
        dist: The run's :class:`DistState`.
        loader: The prepared loader (any iterable of batches).
        items: Counts the items of one batch, for loss by item count.
        atoms: Exact mode's atom count per global batch: a power of two that
            the data-parallel size divides.
        model: The prepared model, with ``atoms``.

    Raises:
        ArgumentValueError: ``items`` returned a negative count or a non-integer;
            with ``atoms``, a count or loader exact mode cannot split the same way
            at every size (the message says why and what to change).
        ArgumentError: ``atoms`` without ``model=``, or without a prepared loader.
        UsageError: ``atoms`` under FSDP2, DeepSpeed, tensor parallelism or
            pipelines, or ranks with different thread counts (or, on CUDA,
            without deterministic algorithms).

    Example:
        >>> import faccel
        >>> dist = faccel.DistState(accumulation_steps=2)
        >>> [(m.index, m.sync, m.group_size) for m, _ in faccel.micro_batches(dist, "abc")]
        [(0, False, 2), (1, True, 2), (2, True, 1)]
        >>> [m.items for m, _ in faccel.micro_batches(dist, ["ab", "cde", "f"], items=len)]
        [5, 5, 1]
    """
    k = dist.accumulation_steps
    start = getattr(loader, "start", 0)
    if atoms is not None or model is not None:
        yield from _exact(dist, loader, items, atoms, model, k, start)
        return
    if items is not None:
        yield from _counted(dist, loader, items, k, start)
        return
    try:
        total: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:
        total = None
    if total is not None:
        # sync_boundary inlined, and the tuple made without the named tuple's keyword parsing:
        # this loop runs once per micro-batch, inside the training step.
        make = tuple.__new__
        for index, batch in enumerate(loader, start):
            first = index - index % k
            end = min(first + k, total)
            yield make(MicroStep, (index, index == end - 1, end - first, None, None)), batch
        return
    # Groups stay aligned to the epoch (index // k) when resuming mid-epoch.
    index = start
    for group in _groups(loader, k, k - start % k):
        size = index % k + len(group)
        for position, batch in enumerate(group):
            micro = MicroStep(index=index, sync=position == len(group) - 1, group_size=size)
            yield micro, batch
            index += 1


def _counted(
    dist: DistState, loader: Iterable[Any], count: Callable[[Any], int], k: int, start: int
) -> Iterator[tuple[MicroStep, Any]]:
    """Groups read ahead and counted: one scalar collective per group gives its global item count."""
    index = start
    for group in _groups(loader, k, k - start % k):
        total = _global_items(dist, sum(_count(count, batch) for batch in group))
        size = index % k + len(group)
        for position, batch in enumerate(group):
            sync = position == len(group) - 1
            yield MicroStep(index=index, sync=sync, group_size=size, items=total), batch
            index += 1


def _count(count: Callable[[Any], int], batch: Any) -> int:
    n = count(batch)
    if isinstance(n, torch.Tensor) and n.numel() == 1:
        n = int(n.item())
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        msg = f"micro_batches(items=...) must return a count >= 0 for each batch, got {n!r}"
        raise ArgumentValueError(msg)
    return n


def _exact(
    dist: DistState,
    loader: Iterable[Any],
    count: Callable[[Any], int] | None,
    atoms: int | None,
    model: nn.Module | None,
    k: int,
    start: int,
) -> Iterator[tuple[MicroStep, Any]]:
    """Exact mode: each group read ahead, then its atoms in the tree's order (``_exact``)."""
    if atoms is None:
        msg = "micro_batches(..., model=...) is for exact mode and needs atoms= as well (docs/exact.md)"
        raise ArgumentError(msg)
    run = ExactRun(dist, loader, atoms, model)
    index = start
    for group in _groups(loader, k, k - start % k):
        total = None if count is None else _global_items(dist, sum(_count(count, b) for b in group))
        yield from run.pieces(index, group, total)
        index += len(group)


def _global_items(dist: DistState, local: int) -> int:
    """The data-parallel sum of ``local``: one all-reduce of one integer (TP peers share a batch)."""
    if not dist.distributed:
        return local
    import torch.distributed as torch_dist

    summed = torch.tensor([local], dtype=torch.int64, device=dist.device)
    torch_dist.all_reduce(summed)
    # Every rank of a tensor-parallel group reads the same batch: the world sum counts it that often.
    return int(summed.item()) // (dist.world_size // dist.data_world_size)


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
    syncing micro-step all-reduces the accumulated sum once. In exact mode
    every micro-step skips DDP's all-reduce (``backward`` sums the atoms). FSDP2 models get
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
    if micro.atom is not None and dist.distributed:  # exact mode reduces the atoms itself
        return model.no_sync() if isinstance(model, DistributedDataParallel) else _NOTHING
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
