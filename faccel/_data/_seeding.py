"""Loader workers' random numbers: each batch's seed, a pure function of where it sits in the run.

``prepare(..., worker_seeds=...)`` chooses how (``faccel._choices.WorkerSeeds``):
``'rank'`` seeds each batch from ``(dist.seed, epoch, rank, batch)``,
``'shared'`` the same without the rank, ``'torch'`` leaves it to the
DataLoader's own per-worker seeding (from the view's generator, seeded from
``(dist.seed, epoch, start)``). A batch of indices carries its seed
(:class:`SeededBatch`) to the worker that fetches it, which reseeds its
generators first (:class:`SeedingDataset`), so a resumed run draws the same
numbers as the straight one whichever worker fetches the batch.
"""

from __future__ import annotations

import random
import sys
from typing import Any

import torch
from torch.utils.data import Dataset, get_worker_info

__all__ = ["SeededBatch", "SeedingDataset", "seed_of"]


def seed_of(*parts: int) -> int:
    """A 63-bit seed from integers, the same on every run and machine.

    Example:
        >>> seed_of(0, 1, 2) == seed_of(0, 1, 2) != seed_of(0, 1, 3)
        True
    """
    # hash() of a tuple of ints does not depend on PYTHONHASHSEED: the same on every run.
    return hash(parts) & (2**63 - 1)


class SeededBatch(list):  # type: ignore[type-arg]
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


class SeedingDataset(Dataset):  # type: ignore[type-arg]
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
