"""A user's ``DataLoader`` rebuilt for one rank: its plan, its recipe, and each view's own loader.

``prepare`` reads the user's loader once into a :class:`Recipe` (what every
view of it reads, and how: nothing about where a view starts) and a
:class:`Sharding` (which samples this rank reads). Each view of the prepared
loader then gets its own ``DataLoader``, its own batch sampler or stream
fixed at its ``(epoch, start, consumed)``, and its own generator
(:func:`build`): views share nothing that iterating changes. The one
exception is ``persistent_workers=True``, whose point is one ``DataLoader``
(and its workers) for every epoch: its views share it, its sampler is
pointed at each view just before the view's iterator draws its batches
(eagerly), and an iteration that another one reset raises (docs/data.md).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal

import attrs
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from faccel._choices import WorkerSeeds
from faccel._data._samplers import check_repeatable
from faccel._data._seeding import SeededBatch, SeedingDataset, seed_of
from faccel._data._sharding import Sharding
from faccel._data._stream import ShardedStream, length_or_zero
from faccel._dist._state import DistState
from faccel._torch_compat import random_sampler_draws_all
from faccel.errors import PrepareError

__all__ = ["Recipe", "ShardBatchSampler", "build", "make_recipe"]


class ShardBatchSampler(Sampler[list[int]]):
    """Yields one rank's batches of one ``(epoch, start, consumed)``.

    Each view has its own, fixed when it is made; only the shared sampler of a
    ``persistent_workers`` loader is pointed again (:meth:`point`), by each
    iteration, just before ``iter(dataloader)`` draws the whole list eagerly.
    """

    def __init__(
        self,
        sharding: Sharding,
        *,
        flat: bool = False,
        seeds: WorkerSeeds = "rank",
        at: tuple[int, int, int] = (0, 0, 0),
    ) -> None:
        self.sharding = sharding
        self.flat = flat  # batch_size=None: yield each rank's indices one by one
        self.seeds = seeds
        self._at = at

    def point(self, epoch: int, start: int, consumed: int = 0) -> None:
        """Point the shared sampler of a ``persistent_workers`` loader at a view's position."""
        self._at = (epoch, start, consumed)

    def __iter__(self) -> Iterator[Any]:
        epoch, start, consumed = self._at
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
        return (SeededBatch(batch, seed_of(*head, start + k)) for k, batch in enumerate(batches))

    def __len__(self) -> int:
        return self.sharding.num_batches


class _First:
    """A collate function for loaders without batching: one item at a time (kept picklable for workers)."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, items: list[Any]) -> Any:
        return self.collate(items[0])


@attrs.frozen(kw_only=True, eq=False)
class Recipe:
    """How every view of one prepared loader builds its ``DataLoader``; it holds no position.

    Attributes:
        data: What the view's DataLoader reads: the user's dataset (or its
            :class:`SeedingDataset`), or the user's ``IterableDataset``.
        kind: ``'batches'`` (a batch sampler of this rank's batches), ``'flat'``
            (``batch_size=None``: each item a batch) or ``'stream'``.
        batched: Whether the loader batches samples (False: each unit -- a batch
            sampler's batch, or an item of a loader with ``batch_size=None`` -- is
            one loader batch).
        worker_seeds: ``prepare``'s ``worker_seeds``: how the view's generator is
            seeded, and the seeds the batch sampler attaches where ``reseed``.
        reseed: Whether workers reseed before each batch (``data`` is a
            :class:`SeedingDataset`: map-style, batched, with workers).
        collate: The user's collate function.
        options: The user's other DataLoader options (workers, pinning...).
    """

    data: Any
    kind: Literal["batches", "flat", "stream"]
    batched: bool
    worker_seeds: WorkerSeeds
    reseed: bool
    collate: Callable[[Any], Any]
    options: Mapping[str, Any]

    @property
    def persistent(self) -> bool:
        """Whether the views share one DataLoader (``persistent_workers=True``)."""
        return bool(self.options.get("persistent_workers"))


def build(recipe: Recipe, sharding: Sharding, *, epoch: int, start: int, consumed: int) -> DataLoader:  # type: ignore[type-arg]
    """A new DataLoader of this rank's batches at ``(epoch, start, consumed)``, with its own generator."""
    seeder = torch.Generator()
    options = dict(recipe.options)
    if recipe.kind == "stream":
        stream = ShardedStream(recipe.data, sharding, start=start)
        collate = recipe.collate if recipe.batched else _First(recipe.collate)
        return DataLoader(stream, batch_size=None, collate_fn=collate, generator=seeder, **options)
    if recipe.kind == "flat":
        control = ShardBatchSampler(sharding, flat=True, at=(epoch, start, consumed))
        return DataLoader(
            recipe.data,
            sampler=control,
            batch_size=None,
            collate_fn=recipe.collate,
            generator=seeder,
            **options,
        )
    seeds: WorkerSeeds = recipe.worker_seeds if recipe.reseed else "torch"
    control = ShardBatchSampler(sharding, seeds=seeds, at=(epoch, start, consumed))
    return DataLoader(
        recipe.data, batch_sampler=control, collate_fn=recipe.collate, generator=seeder, **options
    )


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


def make_recipe(
    dist: DistState,
    loader: DataLoader,  # type: ignore[type-arg]
    *,
    even_batches: bool,
    split_batches: bool,
    worker_seeds: WorkerSeeds,
) -> tuple[Recipe, Sharding]:
    """Read the user's ``loader`` once: the recipe of its views and this rank's sharding.

    Raises:
        PrepareError: The loader cannot be sharded as asked (the message says why and what to do).
    """
    options = _loader_options(loader)
    collate: Callable[[Any], Any] = options.pop("collate_fn")
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
        batcher: Any = loader.batch_sampler
        batched = batcher is not None
        batch_size, drop_last = (batcher.batch_size, batcher.drop_last) if batched else (1, False)
        if split_batches:
            batch_size = _split_size(dist, batch_size if batched else None)
        sharding = Sharding(
            num_samples=length_or_zero(dataset),
            batch_size=batch_size,
            rank=dist.data_rank,  # the ranks of a tensor-parallel group read the same batches
            world_size=dist.data_world_size,
            drop_last=drop_last,
            even_batches=even_batches,
            seed=dist.seed,
        )
        recipe = Recipe(
            data=dataset,
            kind="stream",
            batched=batched,
            worker_seeds=worker_seeds,
            reseed=False,
            collate=collate,
            options=options,
        )
        return recipe, sharding
    sharding, batched = _plan(dist, loader, even_batches, split_batches)
    reseed = worker_seeds != "torch" and loader.num_workers > 0 and loader.batch_sampler is not None
    data = SeedingDataset(dataset) if reseed else dataset
    flat = (
        not batched and loader.batch_sampler is None
    )  # batch_size=None: the dataset's items are the batches
    recipe = Recipe(
        data=data,
        kind="flat" if flat else "batches",
        batched=batched,
        worker_seeds=worker_seeds,
        reseed=reseed and not flat,
        collate=collate,
        options=options,
    )
    return recipe, sharding
