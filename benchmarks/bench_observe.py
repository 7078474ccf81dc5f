"""The meter's price: a training step with ``faccel.measure`` vs the same step without it.

The setting is bench_step's: one thread, SGD + LambdaLR, the seed's small MLP
(32-64-64-1, batch 32, MSE) through ``faccel.prepare`` and ``faccel.backward``.
Both subjects train their own copy of the same model (the same seed) on the
same cycled batches, in the same step function; the metered one adds the one
call a step (``meter = faccel.measure(dist, meter, items=32)``: the clock, a
few stores into the meter, the peak RSS every 0.05 s). The target: at most 1%
over the same loop without it.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.bench_step import _parts, batches
from benchmarks.common import FACCEL, Row, interleave, per_call, rows

WITHOUT = "faccel, no meter"
SIZES, BATCH = (32, 64, 64, 1), 32


def _loop(*, metered: bool) -> Callable[[], None]:
    import faccel

    dist = faccel.detect({})
    model, optimizer, scheduler = faccel.prepare(dist, *_parts(SIZES))
    data = itertools.cycle(batches(SIZES, BATCH, classes=False))
    loss_fn = nn.functional.mse_loss
    meter = [faccel.start_meter(dist)]  # the loop's own variable, kept across blocks

    def step() -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        faccel.backward(dist, loss_fn(model(inputs), targets))
        optimizer.step()
        scheduler.step()
        if metered:  # the same function for both subjects: they differ by this call alone
            meter[0] = faccel.measure(dist, meter[0], items=BATCH)

    return step


def run(quick: bool) -> list[Row]:
    torch.set_num_threads(1)
    rounds, steps = (25, 40) if quick else (100, 200)
    subjects = {WITHOUT: _loop(metered=False), FACCEL: _loop(metered=True)}
    timed = {name: functools.partial(per_call, step, steps) for name, step in subjects.items()}
    samples = interleave(timed, rounds=rounds)
    return rows(
        f"small MLP 32-64-64-1, batch 32 ({steps} steps a block)",
        samples,
        baseline=WITHOUT,
        unit="us/step",
        scale=1e6,
        goals="observe_step",
        notes={FACCEL: "with faccel.measure once a step"},
    )
