"""Batch iteration: an epoch of a prepared loader vs the raw DataLoader it came from.

A TensorDataset of 4096 samples of 32 features, batch 32, shuffled: the loop body
does nothing, so the figure is the loaders' own cost per batch (sampling, collation,
device placement). Each subject iterates a new epoch in every block.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from benchmarks.common import ACCELERATE, FABRIC, FACCEL, PLAIN, Row, anchors, clock, interleave, rows

SAMPLES, FEATURES, BATCH = 4096, 32, 32


def _loader() -> DataLoader:  # type: ignore[type-arg]
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, 1, generator=g))
    return DataLoader(data, batch_size=BATCH, shuffle=True)


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


def plain() -> Callable[[], float]:
    loader = _loader()
    return _epoch_timer(lambda: loader)


def with_faccel() -> Callable[[], float]:
    import faccel

    loader = faccel.prepare(faccel.detect({}), _loader())
    epoch = itertools.count()
    return _epoch_timer(lambda: loader.at(epoch=next(epoch)))


def with_accelerate() -> Callable[[], float]:
    from accelerate import Accelerator

    loader = Accelerator().prepare(_loader())
    return _epoch_timer(lambda: loader)


def with_fabric() -> Callable[[], float]:
    from lightning.fabric import Fabric

    loader = Fabric(accelerator="cpu", devices=1).setup_dataloaders(_loader())
    return _epoch_timer(lambda: loader)


MAKERS = {PLAIN: plain, FACCEL: with_faccel, ACCELERATE: with_accelerate, FABRIC: with_fabric}


def run(quick: bool) -> list[Row]:
    torch.set_num_threads(1)
    installed = anchors()
    subjects = {name: make() for name, make in MAKERS.items() if installed.get(name, True)}
    samples = interleave(subjects, rounds=15 if quick else 60)
    case = f"TensorDataset {SAMPLES}x{FEATURES}, batch {BATCH}, shuffle (an epoch a block)"
    return rows(case, samples, baseline=PLAIN, unit="us/batch", scale=1e6, goals="batch_iteration")
