"""Prepared data loaders: each rank's shard, on the right device, at a chosen epoch.

A :class:`PreparedLoader` is a frozen view of a rebuilt ``DataLoader``: it
holds the epoch and the batch to start from as plain values. Iterating the
same view twice yields the same batches; move on with
``loader.at(epoch=e)`` (and resume with ``loader.at(epoch=e, start=k)``, or
with ``loader.resume(state)`` after a restore, at any world size).
Nothing counts epochs behind your back.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import attrs
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from faccel._data._samplers import check_repeatable
from faccel._data._sharding import Sharding
from faccel._dist._runtime import LoaderRecord, Runtime
from faccel._dist._state import DistState
from faccel._torch_compat import random_sampler_draws_all
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

    def __init__(self, sharding: Sharding, *, flat: bool = False, seeds: str = "rank") -> None:
        self.sharding = sharding
        self.flat = flat  # batch_size=None: yield each rank's indices one by one
        self.seeds = seeds
        self._next: tuple[int, int, int] = (0, 0, 0)

    def point(self, epoch: int, start: int, consumed: int = 0) -> None:
        self._next = (epoch, start, consumed)

    def __iter__(self) -> Iterator[Any]:
        epoch, start, consumed = self._next
        s = attrs.evolve(self.sharding, consumed=consumed) if consumed else self.sharding
        batches = s.batches(epoch=epoch, start=start)
        if self.flat:
            return (batch[0] for batch in batches)
        if self.seeds == "torch":
            return iter(batches)
        rank = s.rank if self.seeds == "rank" else -1
        # A resume at another world size numbers its batches afresh: its global position keeps
        # their seeds apart from the first run's.
        head = (s.seed, epoch, rank) if not consumed else (s.seed, epoch, rank, consumed)
        return (_SeededBatch(batch, _seed_of(*head, start + k)) for k, batch in enumerate(batches))

    def __len__(self) -> int:
        return self.sharding.num_batches


def _seed_of(*parts: int) -> int:
    # hash() of a tuple of ints does not depend on PYTHONHASHSEED: the same on every run.
    return hash(parts) & (2**63 - 1)


class _SeededBatch(list):  # type: ignore[type-arg]
    """A batch of indices that carries the seed its worker draws its random numbers from."""

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed


def _seed_generators(seed: int) -> None:
    """Seed torch's CPU generator, ``random`` and (if imported) numpy's in this loader worker."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed(seed % 2**32)


class _SeedingDataset(Dataset):  # type: ignore[type-arg]
    """The user's map dataset, reseeding a worker's generators before each batch it fetches.

    Each batch's random numbers (augmentations) are then a function of
    ``(seed, epoch, rank, batch)``: the same in a resumed run as in the straight
    one, whichever worker fetches the batch. In the main process
    (``num_workers=0``) nothing is reseeded: the generators there are the
    training loop's.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, batch: list[int]) -> list[Any]:
        seed = getattr(batch, "seed", None)
        if seed is not None and get_worker_info() is not None:
            _seed_generators(seed)
        fetch = getattr(self.dataset, "__getitems__", None)
        if fetch:
            return fetch(list(batch))  # type: ignore[no-any-return]
        return [self.dataset[i] for i in batch]


class _First:
    """A collate function for loaders without batching: one item at a time (kept picklable for workers)."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[Any]) -> Any:
        return self.collate(items[0])


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


class _Position(Protocol):
    """Where a :class:`faccel.TrainState` says the data stopped (what :meth:`PreparedLoader.resume` reads)."""

    @property
    def epoch(self) -> int: ...
    @property
    def position(self) -> int: ...
    @property
    def consumed(self) -> int: ...


@attrs.frozen(kw_only=True, eq=False)
class PreparedLoader:
    """One rank's view of a dataset: its batches of ``epoch``, from batch ``start``.

    Iterate it like a ``DataLoader``; batches arrive on ``device``. A view is
    a value: iterating it twice yields the same batches, and neither iterating
    nor :func:`faccel.restore` changes any of its fields (what the guards below
    need to know of past iterations is the loader's record in the runtime
    handle of the ``DistState`` it was prepared with). Use :meth:`at` for each
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
        consumed: Global positions of the epoch's order consumed before this
            view deals the rest (by all ranks together, at any world size; see
            :meth:`resume`). 0 but in an epoch resumed at another world size.

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
    consumed: int = 0
    non_blocking: bool = False
    _control: _ShardBatchSampler | _ShardedStream
    _seeder: torch.Generator
    # Whether the loader batches samples (False: each unit -- a batch sampler's batch, or an
    # item of a loader with batch_size=None -- is one loader batch).
    _batched: bool = True
    # Which worker seeds: "rank" (per rank and batch), "shared" (per batch) or "torch".
    _worker_seeds: str = "rank"
    # True on the view prepare() returns only: iterating it twice raises if it shuffles. Views
    # from at() name their epoch, so iterating them again is deliberate.
    _bare: bool = False
    # The handle of the DistState it was prepared with. What this process did with the loader
    # (iterations started, whether the bare view was read, an epoch a restore left to resume
    # from a global position) is the runtime's LoaderRecord, weakly keyed by the rebuilt
    # DataLoader that every view shares: iterating and restoring change no field of a view.
    _runtime: Runtime = attrs.field(factory=Runtime, repr=False)

    @property
    def batch_size(self) -> int | None:
        """The per-process batch size; None where batches come whole (a batch sampler, batch_size=None)."""
        return self.sharding.batch_size if self._batched else None

    @property
    def dataset(self) -> Any:
        """The user's dataset."""
        control = self._control
        if isinstance(control, _ShardedStream):
            return control.dataset
        dataset = self.dataloader.dataset
        return dataset.dataset if isinstance(dataset, _SeedingDataset) else dataset

    @property
    def padding(self) -> int:
        """Samples repeated in an epoch (over all ranks) so batch counts are even.

        Where batches come whole (a batch sampler, ``batch_size=None``) it counts
        the repeated batches (items).

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

    def at(self, *, epoch: int, start: int = 0, consumed: int = 0) -> PreparedLoader:
        """A view of the same loader at ``epoch``, beginning at batch ``start``.

        ``start`` counts this world's batches: ``at(epoch=e, start=k)`` yields
        what an uninterrupted run of the same world size yields from its
        batch ``k``. ``consumed`` skips that many positions of the epoch's
        global order (read by all ranks of any world size together) and deals
        the rest afresh to this world's ranks, the padding rule applied to the
        remainder; ``start`` then counts batches of that dealing. After
        :func:`faccel.restore`, :meth:`resume` passes both for you.

        Raises:
            ArgumentValueError: ``epoch``, ``start`` or ``consumed`` is
                negative, ``consumed`` exceeds the dataset, or ``consumed``
                is given for an ``IterableDataset`` (a stream resumes at
                the world size that read it).

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
        if consumed and isinstance(self._control, _ShardedStream):
            msg = (
                f"consumed={consumed} is for map-style datasets: this loader reads an IterableDataset, "
                "whose stream is dealt as it is read; resume it at the world size that read it, "
                "with at(epoch=..., start=...)"
            )
            raise ArgumentValueError(msg)
        sharding = attrs.evolve(self.sharding, consumed=consumed)  # checks consumed <= num_samples
        return attrs.evolve(self, epoch=epoch, start=start, consumed=consumed, sharding=sharding, bare=False)

    def resume(self, state: _Position) -> PreparedLoader:
        """The view that continues ``state``'s epoch where it stopped, at this world size.

        ``loader.at(epoch=state.epoch, start=state.position, consumed=state.consumed)``:
        after a restore at the same world size, the batches an uninterrupted
        run would read next; after a restore at another world size (which
        sets ``state.consumed`` to the positions all ranks had read and
        ``state.position`` to 0), the rest of the epoch dealt afresh to this
        world's ranks, so that across the two runs every sample of the epoch
        is read once (padding repeats excepted, see :attr:`padding`).

        Raises:
            ArgumentValueError: As :meth:`at`.

        Example:
            >>> import torch, faccel
            >>> data = torch.utils.data.TensorDataset(torch.arange(10))
            >>> loader = faccel.prepare(faccel.detect({}), torch.utils.data.DataLoader(data, batch_size=3))
            >>> state = faccel.TrainState.create(model=torch.nn.Linear(1, 1), optimizer=None,
            ...                                  epoch=0, position=2)
            >>> [batch.tolist() for (batch,) in loader.resume(state)]
            [[6, 7, 8], [9]]
        """
        return self.at(epoch=state.epoch, start=state.position, consumed=state.consumed)

    def expect_resume(self, epoch: int, consumed: int) -> None:
        """Refuse, until it is iterated, any view of ``epoch`` that does not skip ``consumed`` positions.

        :func:`faccel.restore` calls it on ``TrainState.loader`` when the
        epoch continues from a global position (restored at another world
        size): the batch-counting form ``at(epoch=e, start=state.position)``
        would read the epoch again from its start. It changes no field of any
        view: the expectation is kept in the loader's record in the runtime
        handle of the ``DistState`` it was prepared with (docs/data.md).

        Example:
            >>> import torch, faccel
            >>> data = torch.utils.data.TensorDataset(torch.arange(10))
            >>> loader = faccel.prepare(faccel.detect({}), torch.utils.data.DataLoader(data, batch_size=3))
            >>> loader.expect_resume(0, 6)
            >>> [batch.tolist() for (batch,) in loader.at(epoch=0, consumed=6)]
            [[6, 7, 8], [9]]
        """
        self._runtime.loader(self.dataloader).due = (epoch, consumed) if consumed else None

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
        record = self._runtime.loader(self.dataloader)
        if self._bare and self.sharding.shuffle:
            if record.bare_iterated:
                msg = (
                    "this shuffled loader was iterated a second time without naming an epoch: "
                    "`for batch in loader` always yields epoch 0's order, so a bare epoch loop would "
                    "repeat it every epoch; iterate `loader.at(epoch=epoch)` in each epoch instead"
                )
                raise UsageError(msg)
            record.bare_iterated = True
        due = record.due
        if due is not None and due[0] == self.epoch:
            if due[1] != self.consumed:
                msg = (
                    f"epoch {self.epoch} was resumed at another world size: all ranks before had read "
                    f"{due[1]} positions of its order, which this world reads in other batches, so "
                    f"at(epoch={self.epoch}, start=...) alone would read them again. Iterate "
                    f"loader.resume(state) (or loader.at(epoch={self.epoch}, start=state.position, "
                    "consumed=state.consumed))"
                )
                raise UsageError(msg)
            record.due = None
        record.started += 1
        control = self._control
        if isinstance(control, _ShardBatchSampler):
            control.point(self.epoch, self.start, self.consumed)
        else:
            control.start = self.start
        # Worker seeds follow (seed, epoch, start, rank) (and the global position of a resume at
        # another world size), and the global torch RNG is not consumed by the DataLoader;
        # map-style batches are reseeded one by one on top (_SeedingDataset), so a resumed run
        # draws the same random numbers.
        s = self.sharding
        rank = s.rank if self._worker_seeds == "rank" else -1
        where = (
            (self.epoch, self.start, rank)
            if not self.consumed
            else (self.epoch, self.start, rank, self.consumed)
        )
        self._seeder.manual_seed(_seed_of(s.seed, *where))
        iterator: Iterator[Any] = iter(self.dataloader)
        if self.dataloader.persistent_workers:
            iterator = _alone(iterator, record, record.started)
        device, non_blocking = self.device, self.non_blocking
        if device.type == "cpu" and not self.dataloader.pin_memory:
            # Collated batches are already on the CPU: skip the walk over the batch.
            return iterator
        return (to_device(batch, device, non_blocking=non_blocking) for batch in iterator)


def _alone(iterator: Iterator[Any], record: LoaderRecord, mine: int) -> Iterator[Any]:
    """``iterator``'s batches, as long as no other iteration of the loader has started since."""
    while True:
        if record.started != mine:
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


_WORKER_SEEDS = ("rank", "shared", "torch")


def _check_no_distributed_sampler(sampler: object) -> None:
    if isinstance(sampler, DistributedSampler):
        msg = (
            f"this DataLoader already shards with a DistributedSampler (rank {sampler.rank} of "
            f"{sampler.num_replicas}); prepare() deals the data to the ranks itself, so it would shard "
            f"the shard. Build the DataLoader without it (shuffle={sampler.shuffle}, "
            f"drop_last={sampler.drop_last}; the seed is faccel.detect(seed=...)), or give prepare() "
            "the sampler you wrapped in it; see docs/data.md, 'A DistributedSampler'"
        )
        raise PrepareError(msg)


def _check_agreement(dist: DistState, sampler: object, drawn: list[Any]) -> None:
    """Check once, at prepare, that every rank drew the same epoch 0 (one small all_gather).

    A sampler seeded by faccel agrees by construction; one whose order comes from
    its own seed (``set_epoch`` samplers) agrees only if every rank built it alike.
    """
    if not dist.distributed:
        return
    from faccel._dist._collectives import _exchange

    digest = hashlib.sha256(json.dumps(drawn, separators=(",", ":")).encode()).hexdigest()[:16]
    peers = _exchange(dist, {"call": "prepare(loader)", "order": digest})
    differ = [rank for rank, peer in enumerate(peers) if peer["order"] != peers[0]["order"]]
    if differ:
        msg = (
            f"the ranks drew different orders from this {type(sampler).__name__} for epoch 0 (ranks "
            f"{differ} differ from rank 0), so their shares would overlap and miss samples. Its "
            "order comes from state faccel does not seed (its own seed, set per rank?): build it "
            "alike on every rank, or let it draw from a `generator` attribute (faccel reseeds it "
            "from (dist.seed, epoch)); see docs/data.md, 'A custom sampler'"
        )
        raise PrepareError(msg)


def _plain_shuffle(sampler: object) -> bool | None:
    """True/False for the two samplers whose order Sharding draws itself; None for any other."""
    if type(sampler) is SequentialSampler:
        return False
    if type(sampler) is RandomSampler and random_sampler_draws_all(sampler):
        return True
    return None


def _split_size(dist: DistState, batch_size: int | None) -> int:
    """Each rank's slice of a global batch of ``batch_size`` under ``split_batches=True``."""
    if batch_size is None:
        msg = "split_batches=True needs a batch size to split, but this DataLoader has batch_size=None"
        raise PrepareError(msg)
    w = dist.data_world_size
    if batch_size % w:
        msg = (
            f"split_batches=True gives each of the {w} ranks an equal slice of every batch, but "
            f"batch_size={batch_size} is not divisible by {w}; pick a multiple of the world size, "
            f"or split_batches=False for {batch_size} a rank"
        )
        raise PrepareError(msg)
    return batch_size // w


def _plan(
    dist: DistState, loader: DataLoader, even_batches: bool, split_batches: bool
) -> tuple[Sharding, bool]:  # type: ignore[type-arg]
    """The sharding of a map-style loader, and whether the loader batches samples itself."""
    batcher = loader.batch_sampler
    common: dict[str, Any] = {
        "rank": dist.data_rank,
        "world_size": dist.data_world_size,
        "even_batches": even_batches,
        "seed": dist.seed,
    }
    if batcher is not None and type(batcher) is not BatchSampler:
        # A custom batch sampler: its batches are the units, dealt whole.
        _check_no_distributed_sampler(getattr(batcher, "sampler", None))
        if split_batches:
            msg = (
                f"split_batches=True splits batches of one fixed size, but this DataLoader has a "
                f"batch sampler ({type(batcher).__name__}) whose batches prepare() deals whole to the "
                "ranks; drop split_batches (each rank then takes whole batches of it)"
            )
            raise PrepareError(msg)
        units = check_repeatable(batcher, dist.seed, batches=True)
        _check_agreement(dist, batcher, units)
        sharding = Sharding(
            num_samples=len(units), batch_size=1, sampler=batcher, whole_batches=True, **common
        )
        return sharding, False
    sampler = loader.sampler if batcher is None else batcher.sampler
    _check_no_distributed_sampler(sampler)
    batch_size, drop_last = (1, False) if batcher is None else (batcher.batch_size, batcher.drop_last)
    if split_batches:
        batch_size = _split_size(dist, batch_size if batcher is not None else None)
    shuffle = _plain_shuffle(sampler)
    if shuffle is not None:
        n = len(loader.dataset)  # type: ignore[arg-type]
        sharding = Sharding(
            num_samples=n, batch_size=batch_size, shuffle=shuffle, drop_last=drop_last, **common
        )
    else:
        order = check_repeatable(sampler, dist.seed)
        _check_agreement(dist, sampler, order)
        sharding = Sharding(
            num_samples=len(order), batch_size=batch_size, drop_last=drop_last, sampler=sampler, **common
        )
    return sharding, batcher is not None


def prepare_loader(
    dist: DistState,
    loader: DataLoader,  # type: ignore[type-arg]
    *,
    even_batches: bool = True,
    split_batches: bool = False,
    worker_seeds: str = "rank",
) -> PreparedLoader:
    """Rebuild ``loader`` so this rank reads its shard; see :class:`PreparedLoader`.

    Raises:
        PrepareError: The loader cannot be sharded as asked (the message says why and what to do).
        ArgumentValueError: ``worker_seeds`` is not one of ``'rank'``, ``'shared'``, ``'torch'``.

    Example:
        >>> import torch, faccel
        >>> data = torch.utils.data.TensorDataset(torch.arange(6))
        >>> dist = faccel.DistState.simulated(rank=1, world_size=2)
        >>> [b.tolist() for (b,) in prepare_loader(dist, torch.utils.data.DataLoader(data, batch_size=2))]
        [[1, 3], [5]]
    """
    if worker_seeds not in _WORKER_SEEDS:
        msg = f"worker_seeds must be one of {_WORKER_SEEDS}, got {worker_seeds!r}"
        raise ArgumentValueError(msg)
    seeder = torch.Generator()
    options = _loader_options(loader)
    collate: Callable[[Any], Any] = options.pop("collate_fn")
    dataset = loader.dataset
    control: _ShardBatchSampler | _ShardedStream
    if isinstance(dataset, IterableDataset):
        if loader.persistent_workers:
            # Persistent workers keep the copy of the stream they started with, so they
            # could not follow a resume position set later.
            msg = (
                "persistent_workers=True cannot be combined with an IterableDataset in prepare(): "
                "the workers would not see resume positions; build the DataLoader without it"
            )
            raise PrepareError(msg)
        batcher: Any = loader.batch_sampler
        batched = batcher is not None
        batch_size, drop_last = (batcher.batch_size, batcher.drop_last) if batched else (1, False)
        if split_batches:
            batch_size = _split_size(dist, batch_size if batched else None)
        sharding = Sharding(
            num_samples=_length_or_zero(dataset),
            batch_size=batch_size,
            rank=dist.data_rank,  # the ranks of a tensor-parallel group read the same batches
            world_size=dist.data_world_size,
            drop_last=drop_last,
            even_batches=even_batches,
            seed=dist.seed,
        )
        stream = _ShardedStream(dataset, sharding)
        rebuilt = DataLoader(
            stream,
            batch_size=None,
            collate_fn=collate if batched else _First(collate),
            generator=seeder,
            **options,
        )
        control = stream
    else:
        sharding, batched = _plan(dist, loader, even_batches, split_batches)
        reseed = worker_seeds != "torch" and loader.num_workers > 0 and loader.batch_sampler is not None
        data = _SeedingDataset(dataset) if reseed else dataset
        if batched or loader.batch_sampler is not None:
            control = _ShardBatchSampler(sharding, seeds=worker_seeds if reseed else "torch")
            rebuilt = DataLoader(data, batch_sampler=control, collate_fn=collate, generator=seeder, **options)
        else:  # batch_size=None: the dataset's items are the batches
            control = _ShardBatchSampler(sharding, flat=True)
            rebuilt = DataLoader(
                data, sampler=control, batch_size=None, collate_fn=collate, generator=seeder, **options
            )
    return PreparedLoader(
        dataloader=rebuilt,
        sharding=sharding,
        device=dist.device,
        non_blocking=loader.pin_memory and dist.device.type == "cuda",
        control=control,
        seeder=seeder,
        bare=True,
        runtime=dist.runtime,
        batched=batched,
        worker_seeds=worker_seeds,
    )


def _length_or_zero(dataset: object) -> int:
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return 0
