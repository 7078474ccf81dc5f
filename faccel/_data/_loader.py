"""Prepared data loaders: each rank's shard, on the right device, at a chosen epoch.

A :class:`PreparedLoader` is a frozen view of a rebuilt ``DataLoader``: it
holds the epoch and the batch to start from as plain values. Iterating the
same view twice yields the same batches; move on with
``loader.at(epoch=e)`` (and resume with ``loader.at(epoch=e, start=k)``, or
with ``loader.resume(state)`` after a restore, at any world size).
Nothing counts epochs behind your back.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import attrs
import torch
from torch.utils.data import DataLoader

from faccel._choices import WORKER_SEEDS, WorkerSeeds
from faccel._data._rebuild import Recipe, ShardBatchSampler, build, make_recipe
from faccel._data._seeding import SeedingDataset, seed_of
from faccel._data._sharding import Sharding
from faccel._dist._runtime import LoaderRecord, Runtime
from faccel._dist._state import DistState
from faccel._tree import map_tensors
from faccel.errors import ArgumentError, ArgumentValueError, UsageError

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


class _LoaderKey:
    """What every view of one prepared loader shares: the key of its record in the runtime handle.

    It holds nothing; the record (``dist.runtime.loader(key)``) holds what the
    guards need to know of past iterations.
    """


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
    # How every view of this loader builds its DataLoader (no position in it), and the key of the
    # loader's record in the runtime handle; each view's DataLoader, batch sampler or stream and
    # generator are its own (one shared DataLoader under persistent_workers: faccel._data._rebuild).
    _recipe: Recipe
    _key: _LoaderKey = attrs.field(factory=_LoaderKey, repr=False)
    # True on the view prepare() returns only: iterating it twice raises if it shuffles. Views
    # from at() name their epoch, so iterating them again is deliberate.
    _bare: bool = False
    # The handle of the DistState it was prepared with. What this process did with the loader
    # (iterations started, whether the bare view was read, an epoch a restore left to resume
    # from a global position) is the runtime's LoaderRecord, weakly keyed by the _LoaderKey
    # that every view shares: iterating and restoring change no field of a view.
    _runtime: Runtime = attrs.field(factory=Runtime, repr=False)

    @property
    def batch_size(self) -> int | None:
        """The per-process batch size; None where batches come whole (a batch sampler, batch_size=None)."""
        return self.sharding.batch_size if self._recipe.batched else None

    @property
    def dataset(self) -> Any:
        """The user's dataset."""
        data = self._recipe.data
        return data.dataset if isinstance(data, SeedingDataset) else data

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
        if self._recipe.kind != "stream":
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
        if consumed and self._recipe.kind == "stream":
            msg = (
                f"consumed={consumed} is for map-style datasets: this loader reads an IterableDataset, "
                "whose stream is dealt as it is read; resume it at the world size that read it, "
                "with at(epoch=..., start=...)"
            )
            raise ArgumentValueError(msg)
        sharding = attrs.evolve(self.sharding, consumed=consumed)  # checks consumed <= num_samples
        recipe = self._recipe
        dataloader = (
            self.dataloader
            if recipe.persistent
            else build(recipe, sharding, epoch=epoch, start=start, consumed=consumed)
        )
        return attrs.evolve(
            self,
            dataloader=dataloader,
            epoch=epoch,
            start=start,
            consumed=consumed,
            sharding=sharding,
            bare=False,
        )

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
        self._runtime.loader(self._key).due = (epoch, consumed) if consumed else None

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
        record = self._runtime.loader(self._key)
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
        dataloader = self.dataloader
        if self._recipe.persistent:  # the one shared DataLoader: pointed here, drawn eagerly below
            control = dataloader.batch_sampler if dataloader.batch_sampler is not None else dataloader.sampler
            if isinstance(control, ShardBatchSampler):  # always, as build() made it (no stream persists)
                control.point(self.epoch, self.start, self.consumed)
        # Worker seeds follow (seed, epoch, start, rank) (and the global position of a resume at
        # another world size), and the global torch RNG is not consumed by the DataLoader;
        # map-style batches are reseeded one by one on top (SeedingDataset), so a resumed run
        # draws the same random numbers.
        s = self.sharding
        rank = s.rank if self._recipe.worker_seeds == "rank" else -1
        where = (
            (self.epoch, self.start, rank)
            if not self.consumed
            else (self.epoch, self.start, rank, self.consumed)
        )
        dataloader.generator.manual_seed(seed_of(s.seed, *where))
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


def prepare_loader(
    dist: DistState,
    loader: DataLoader,  # type: ignore[type-arg]
    *,
    even_batches: bool = True,
    split_batches: bool = False,
    worker_seeds: WorkerSeeds = "rank",
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
    WORKER_SEEDS.check(worker_seeds)
    recipe, sharding = make_recipe(
        dist, loader, even_batches=even_batches, split_batches=split_batches, worker_seeds=worker_seeds
    )
    return PreparedLoader(
        dataloader=build(recipe, sharding, epoch=0, start=0, consumed=0),
        sharding=sharding,
        device=dist.device,
        non_blocking=loader.pin_memory and dist.device.type == "cuda",
        recipe=recipe,
        bare=True,
        runtime=dist.runtime,
    )
