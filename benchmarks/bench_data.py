"""Batch iteration: an epoch of a prepared loader vs the raw DataLoader it came from.

A TensorDataset of 4096 samples of 32 features, batch 32, shuffled: the loop body
does nothing, so the figure is the loaders' own cost per batch (sampling, collation,
device placement). Each subject iterates a new epoch in every block. The second
case batches the same data with a length-grouped batch sampler (batches of 32 of
similar length, drawn from its generator), which faccel deals whole to the ranks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

from benchmarks.common import ACCELERATE, FABRIC, FACCEL, PLAIN, Row, anchors, clock, interleave, rows

SAMPLES, FEATURES, BATCH = 4096, 32, 32


def _data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, 1, generator=g))


def _loader() -> DataLoader:  # type: ignore[type-arg]
    return DataLoader(_data(), batch_size=BATCH, shuffle=True)


class LengthGrouped(Sampler[list[int]]):
    """Shuffle, sort chunks of 8 batches by length, cut into batches, shuffle the batches."""

    def __init__(self, lengths: list[int], batch_size: int) -> None:
        self.lengths, self.batch_size = lengths, batch_size
        self.generator: torch.Generator | None = torch.Generator().manual_seed(0)

    def __iter__(self) -> Any:
        order = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        chunk = 8 * self.batch_size
        batches = []
        for i in range(0, len(order), chunk):
            ranked = sorted(order[i : i + chunk], key=self.lengths.__getitem__)
            batches += [ranked[k : k + self.batch_size] for k in range(0, len(ranked), self.batch_size)]
        return iter([batches[i] for i in torch.randperm(len(batches), generator=self.generator).tolist()])

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)


def _bucketed() -> DataLoader:  # type: ignore[type-arg]
    lengths = torch.randint(1, 512, (SAMPLES,), generator=torch.Generator().manual_seed(1)).tolist()
    return DataLoader(_data(), batch_sampler=LengthGrouped(lengths, BATCH))


def _epoch_timer(epochs: Callable[[], Iterable[Any]]) -> Callable[[], float]:
    """Seconds per batch of one epoch of the loader that ``epochs()`` returns."""

    def timed() -> float:
        now = clock()
        start = now()
        count = 0
        for _ in epochs():
            count += 1
        return (now() - start) / count

    return timed


def plain(make: Callable[[], DataLoader] = _loader) -> Callable[[], float]:  # type: ignore[type-arg]
    loader = make()
    return _epoch_timer(lambda: loader)


def with_faccel(make: Callable[[], DataLoader] = _loader) -> Callable[[], float]:  # type: ignore[type-arg]
    import faccel

    loader = faccel.prepare(faccel.detect({}), make())
    epoch = itertools.count()
    return _epoch_timer(lambda: loader.at(epoch=next(epoch)))


def with_accelerate(make: Callable[[], DataLoader] = _loader) -> Callable[[], float]:  # type: ignore[type-arg]
    from accelerate import Accelerator

    loader = Accelerator().prepare(make())
    return _epoch_timer(lambda: loader)


def with_fabric(make: Callable[[], DataLoader] = _loader) -> Callable[[], float]:  # type: ignore[type-arg]
    from lightning.fabric import Fabric

    loader = Fabric(accelerator="cpu", devices=1).setup_dataloaders(make())
    return _epoch_timer(lambda: loader)


MAKERS = {PLAIN: plain, FACCEL: with_faccel, ACCELERATE: with_accelerate, FABRIC: with_fabric}


def run(quick: bool) -> list[Row]:
    torch.set_num_threads(1)
    installed = anchors()
    out = []
    cases = (
        (
            _loader,
            f"TensorDataset {SAMPLES}x{FEATURES}, batch {BATCH}, shuffle (an epoch a block)",
            "batch_iteration",
        ),
        (
            _bucketed,
            f"TensorDataset {SAMPLES}x{FEATURES}, length-grouped batch sampler, batches of {BATCH}",
            None,
        ),
    )
    for make, case, goals in cases:
        subjects = {name: maker(make) for name, maker in MAKERS.items() if installed.get(name, True)}
        samples = interleave(subjects, rounds=15 if quick else 60)
        out += rows(case, samples, baseline=PLAIN, unit="us/batch", scale=1e6, goals=goals)
    return out
