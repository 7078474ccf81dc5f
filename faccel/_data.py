"""Prepared data loaders: each rank's shard, on the right device, at a chosen epoch.

A :class:`PreparedLoader` is a frozen view of a rebuilt ``DataLoader``: it
holds the epoch and the batch to start from as plain values. Iterating the
same view twice yields the same batches; move on with
``loader.at(epoch=e)`` (and resume with ``loader.at(epoch=e, start=k)``).
Nothing counts epochs behind your back.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import attrs
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from faccel._sharding import Sharding
from faccel._state import DistState
from faccel._tree import map_tensors
from faccel.errors import ArgumentError, ArgumentValueError, PrepareError, UsageError

__all__ = ["PreparedLoader", "prepare_loader", "to_device"]


def to_device(tree: Any, device: torch.device, *, non_blocking: bool = False) -> Any:
    """Move every tensor in nested tuples, lists, mappings, named tuples and attrs records to ``device``.

    Other leaves are returned as they are; containers are rebuilt, never mutated.

    Example:
        >>> import torch
        >>> batch = {"x": torch.ones(2), "meta": [torch.zeros(1), "id"]}
        >>> moved = to_device(batch, torch.device("cpu"))
        >>> moved["meta"][1], moved["x"].device.type
        ('id', 'cpu')
    """

    def move(tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == device else tensor.to(device, non_blocking=non_blocking)

    return map_tensors(move, tree)


class _ShardBatchSampler(Sampler[list[int]]):
    """Yields one rank's batches for the epoch and start it was last pointed at.

    ``PreparedLoader.__iter__`` points it and calls ``iter(dataloader)`` straight
    away, which draws the whole list eagerly, so views never see each other's
    position.
    """

    def __init__(self, sharding: Sharding) -> None:
        self.sharding = sharding
        self._next: tuple[int, int] = (0, 0)

    def point(self, epoch: int, start: int) -> None:
        self._next = (epoch, start)

    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self._next
        return iter(self.sharding.batches(epoch=epoch, start=start))

    def __len__(self) -> int:
        return self.sharding.num_batches


class _ShardedStream(IterableDataset):  # type: ignore[type-arg]
    """An IterableDataset's stream dealt to one rank, as lists of samples.

    Every rank reads the whole stream and keeps positions ``p`` with
    ``p % world_size == rank``, the same dealing as :class:`Sharding` without
    shuffling. A batch is released only once the whole round it belongs to has
    been read, so under ``drop_last`` every rank releases the same batches.
    At the end of the stream each rank knows the length and pads exactly as
    ``Sharding`` does, from the first samples of the stream.
    Loader workers split this rank's batches round-robin, which is the order
    the DataLoader collects them in.
    """

    def __init__(self, dataset: Iterable[Any], sharding: Sharding) -> None:
        self.dataset = dataset
        self.sharding = sharding
        self.start = 0

    def _batches(self) -> Iterator[list[Any]]:
        s = self.sharding
        w, b, r = s.world_size, s.batch_size, s.rank
        head: list[Any] = []
        batch: list[Any] = []
        count = 0
        for item in self.dataset:
            if count < w:
                head.append(item)
            if count % w == r:
                batch.append(item)
            count += 1
            if count % (w * b) == 0:  # a round is complete: every rank holds a full batch
                yield batch
                batch = []
        if s.drop_last or count == 0:
            return  # the incomplete last round is dropped on every rank alike
        if s.even_batches:
            # Positions [count, total) repeat the start of the stream; the first
            # that is ours is the next one congruent to r modulo w.
            total = attrs.evolve(s, num_samples=count).total
            first = count + (r - count) % w
            batch.extend(head[p % count] for p in range(first, total, w))
        if batch:
            yield batch

    def __iter__(self) -> Iterator[list[Any]]:
        worker = get_worker_info()
        workers, wid = (1, 0) if worker is None else (worker.num_workers, worker.id)
        for k, batch in enumerate(self._batches()):
            if k >= self.start and (k - self.start) % workers == wid:
                yield batch


@attrs.frozen(kw_only=True, eq=False)
class PreparedLoader:
    """One rank's view of a dataset: its batches of ``epoch``, from batch ``start``.

    Iterate it like a ``DataLoader``; batches arrive on ``device``. A view is
    frozen: iterating it twice yields the same batches. Use :meth:`at` for each
    epoch and to resume mid-epoch. The loader :func:`faccel.prepare` returns is
    the view of epoch 0; if it shuffles, iterating it a second time raises
    :class:`~faccel.errors.UsageError`, because a bare ``for epoch in ...: for
    batch in loader:`` would repeat epoch 0's order every epoch (iterate
    ``loader.at(epoch=epoch)`` instead). With ``persistent_workers=True`` the
    ``DataLoader`` has one iterator, which each iteration resets: read one view at
    a time (a view whose iterator another iteration has reset raises
    :class:`~faccel.errors.UsageError` on its next batch instead of mixing them).

    Attributes:
        dataloader: The rebuilt ``DataLoader`` that reads this rank's shard.
        sharding: The pure plan of which indices this rank sees.
        device: Where batches are moved.
        epoch: The epoch this view yields.
        start: The first batch this view yields (batches consumed before it).

    Example:
        >>> import torch, faccel
        >>> data = torch.utils.data.TensorDataset(torch.arange(10))
        >>> dist = faccel.DistState.simulated(rank=1, world_size=2)
        >>> loader = faccel.prepare(dist, torch.utils.data.DataLoader(data, batch_size=2))
        >>> [batch.tolist() for (batch,) in loader]
        [[1, 3], [5, 7], [9]]
    """

    dataloader: DataLoader  # type: ignore[type-arg]
    sharding: Sharding
    device: torch.device
    epoch: int = 0
    start: int = 0
    non_blocking: bool = False
    _control: _ShardBatchSampler | _ShardedStream
    _seeder: torch.Generator
    # Only on the view prepare() returns: whether it has been iterated (one cell, set once).
    # Views from at() name their epoch, so iterating them again is deliberate.
    _bare_iterated: list[bool] | None = None
    # Shared by every view of one loader: how many iterations have been started. With
    # persistent workers the DataLoader has one iterator, which each new iteration resets.
    _started: list[int] = attrs.field(factory=lambda: [0])

    @property
    def batch_size(self) -> int:
        """The per-process batch size."""
        return self.sharding.batch_size

    @property
    def dataset(self) -> Any:
        """The user's dataset."""
        control = self._control
        return control.dataset if isinstance(control, _ShardedStream) else self.dataloader.dataset

    @property
    def padding(self) -> int:
        """Samples repeated in an epoch (over all ranks) so batch counts are even.

        Raises:
            ArgumentError: The loader reads an ``IterableDataset`` without
                ``__len__`` and pads (``even_batches`` without ``drop_last``): it
                repeats samples from the stream's start once the stream ends, how
                many depends on a length nobody knows beforehand.
        """
        s = self.sharding
        if s.even_batches and not s.drop_last and self._unsized():
            msg = (
                "this loader reads an IterableDataset without __len__, so its padding is unknown: "
                "at the end of the stream each rank repeats samples from its start until every "
                "rank has as many batches (5 samples, batch 2, 2 ranks: 6 are read). Give the "
                "dataset a __len__, or prepare(..., even_batches=False) to repeat none"
            )
            raise ArgumentError(msg)
        return s.padding

    def _unsized(self) -> bool:
        """Whether this loader reads an ``IterableDataset`` without ``__len__``."""
        if not isinstance(self._control, _ShardedStream):
            return False
        try:
            len(self.dataset)
        except TypeError:
            return True
        return False

    def at(self, *, epoch: int, start: int = 0) -> PreparedLoader:
        """A view of the same loader at ``epoch``, beginning at batch ``start``.

        Raises:
            ArgumentValueError: ``epoch`` or ``start`` is negative.

        Example:
            >>> import torch, faccel
            >>> data = torch.utils.data.TensorDataset(torch.arange(8.0))
            >>> loader = faccel.prepare(faccel.detect({}),
            ...     torch.utils.data.DataLoader(data, batch_size=4, shuffle=True))
            >>> [b[0].tolist() for b in loader.at(epoch=1)] == [b[0].tolist() for b in loader]
            False
            >>> len(list(loader.at(epoch=1, start=1)))
            1
        """
        if epoch < 0 or start < 0:
            msg = f"epoch and start must be >= 0, got epoch={epoch!r}, start={start!r}"
            raise ArgumentValueError(msg)
        return attrs.evolve(self, epoch=epoch, start=start, bare_iterated=None)

    def __len__(self) -> int:
        """Batches this rank sees in a whole epoch (``start`` not subtracted).

        Raises:
            ArgumentError: The loader reads an ``IterableDataset`` without ``__len__``
                (a ``TypeError``, as ``len()`` of any object without a length).
        """
        if self._unsized():
            msg = "this loader reads an IterableDataset without __len__, so its length is unknown"
            raise ArgumentError(msg)
        return self.sharding.num_batches

    def __iter__(self) -> Iterator[Any]:
        if self._bare_iterated is not None and self.sharding.shuffle:
            if self._bare_iterated[0]:
                msg = (
                    "this shuffled loader was iterated a second time without naming an epoch: "
                    "`for batch in loader` always yields epoch 0's order, so a bare epoch loop would "
                    "repeat it every epoch; iterate `loader.at(epoch=epoch)` in each epoch instead"
                )
                raise UsageError(msg)
            self._bare_iterated[0] = True
        self._started[0] += 1
        control = self._control
        if isinstance(control, _ShardBatchSampler):
            control.point(self.epoch, self.start)
        else:
            control.start = self.start
        # Worker seeds follow (seed, epoch, start), and the global torch RNG is not
        # consumed by the DataLoader, so a resumed run draws the same random numbers.
        self._seeder.manual_seed(hash((self.sharding.seed, self.epoch, self.start)) & (2**63 - 1))
        iterator: Iterator[Any] = iter(self.dataloader)
        if self.dataloader.persistent_workers:
            iterator = _alone(iterator, self._started, self._started[0])
        device, non_blocking = self.device, self.non_blocking
        if device.type == "cpu" and not self.dataloader.pin_memory:
            # Collated batches are already on the CPU: skip the walk over the batch.
            return iterator
        return (to_device(batch, device, non_blocking=non_blocking) for batch in iterator)


def _alone(iterator: Iterator[Any], started: list[int], mine: int) -> Iterator[Any]:
    """``iterator``'s batches, as long as no other iteration of the loader has started since."""
    while True:
        if started[0] != mine:
            # Checked before each fetch: a fetch would take a batch of the other iteration.
            msg = (
                "another iteration of this loader started while this one was still being read; with "
                "persistent_workers=True the DataLoader has one iterator, which each iteration "
                "resets, so the two would mix their batches. Finish one view before iterating the "
                "next (e.g. not zip(loader.at(epoch=0), loader.at(epoch=1))), or build the "
                "DataLoader without persistent_workers"
            )
            raise UsageError(msg)
        try:
            batch = next(iterator)
        except StopIteration:
            return
        yield batch


def _loader_options(loader: DataLoader) -> dict[str, Any]:  # type: ignore[type-arg]
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    return options


def _shuffle_of(sampler: object) -> bool:
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and not sampler.replacement and sampler._num_samples is None:
        return True
    msg = (
        f"prepare() rebuilds the loader with a sharded sampler, but this loader has a custom "
        f"sampler ({type(sampler).__name__}) whose order faccel cannot reproduce; build the "
        "DataLoader with shuffle=True or shuffle=False, or shard it yourself with faccel.Sharding"
    )
    raise PrepareError(msg)


def prepare_loader(
    dist: DistState,
    loader: DataLoader,  # type: ignore[type-arg]
    *,
    even_batches: bool = True,
) -> PreparedLoader:
    """Rebuild ``loader`` so this rank reads its shard; see :class:`PreparedLoader`."""
    batcher = loader.batch_sampler
    if batcher is None:
        msg = (
            "prepare() needs the per-process batch size, but this DataLoader has batch_size=None; "
            "let the DataLoader batch (batch_size=N) instead of the dataset"
        )
        raise PrepareError(msg)
    if type(batcher) is not BatchSampler:
        msg = (
            f"this DataLoader has a custom batch_sampler ({type(batcher).__name__}) "
            "that prepare() cannot shard; use batch_size=, shuffle= and drop_last= instead"
        )
        raise PrepareError(msg)
    seeder = torch.Generator()
    options = _loader_options(loader)
    dataset = loader.dataset
    if isinstance(dataset, IterableDataset):
        if loader.persistent_workers:
            # Persistent workers keep the copy of the stream they started with, so they
            # could not follow a resume position set later.
            msg = (
                "persistent_workers=True cannot be combined with an IterableDataset in prepare(): "
                "the workers would not see resume positions; build the DataLoader without it"
            )
            raise PrepareError(msg)
        length = _length_or_zero(dataset)
        sharding = Sharding(
            num_samples=length,
            batch_size=batcher.batch_size,
            rank=dist.data_rank,  # the ranks of a tensor-parallel group read the same batches
            world_size=dist.data_world_size,
            drop_last=batcher.drop_last,
            even_batches=even_batches,
            seed=dist.seed,
        )
        stream = _ShardedStream(dataset, sharding)
        collate: Callable[[list[Any]], Any] = options.pop("collate_fn")
        rebuilt = DataLoader(stream, batch_size=None, collate_fn=collate, generator=seeder, **options)
        control: _ShardBatchSampler | _ShardedStream = stream
    else:
        sharding = Sharding(
            num_samples=len(dataset),  # type: ignore[arg-type]
            batch_size=batcher.batch_size,
            rank=dist.data_rank,  # the ranks of a tensor-parallel group read the same batches
            world_size=dist.data_world_size,
            shuffle=_shuffle_of(batcher.sampler),
            drop_last=batcher.drop_last,
            even_batches=even_batches,
            seed=dist.seed,
        )
        control = _ShardBatchSampler(sharding)
        rebuilt = DataLoader(dataset, batch_sampler=control, generator=seeder, **options)
    return PreparedLoader(
        dataloader=rebuilt,
        sharding=sharding,
        device=dist.device,
        non_blocking=loader.pin_memory and dist.device.type == "cuda",
        control=control,
        seeder=seeder,
        bare_iterated=[False],
    )


def _length_or_zero(dataset: object) -> int:
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return 0
