"""Gradient accumulation: a micro-step of faccel's idiom, Accelerate's and Fabric's vs manual accumulation.

The setting: the seed's small MLP (32-64-64-1, batch 32, SGD + LambdaLR, one
thread), 4 micro-steps per optimizer step. The manual loop divides the loss by 4 and
steps every 4th micro-batch; faccel pairs batches with MicroSteps
(``micro_batches``), enters ``accumulate`` and passes ``micro=`` to ``backward``;
Accelerate uses ``accumulate(model)``; Fabric ``no_backward_sync``. Timed per micro-step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from benchmarks.bench_step import Pool, _parts, batches
from benchmarks.common import ACCELERATE, FABRIC, FACCEL, PLAIN, Row, anchors, interleave, per_call, rows

SIZES = (32, 64, 64, 1)
STEPS = 4
Block = Callable[[], None]


def _epoch(pool: Pool, micro_steps: int) -> Pool:
    """``micro_steps`` batches, cycling through the pool (a list: it has a length)."""
    return [pool[i % len(pool)] for i in range(micro_steps)]


def _loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(model(inputs), targets)


def plain(pool: Pool, micro_steps: int) -> Block:
    model, optimizer, scheduler = _parts(SIZES)
    epoch = _epoch(pool, micro_steps)

    def block() -> None:
        for i, (inputs, targets) in enumerate(epoch):
            (_loss(model, inputs, targets) / STEPS).backward()
            if (i + 1) % STEPS == 0 or i + 1 == len(epoch):
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    return block


def with_faccel(pool: Pool, micro_steps: int) -> Block:
    import faccel

    dist = faccel.detect({}, accumulation_steps=STEPS)
    model, optimizer, scheduler = faccel.prepare(dist, *_parts(SIZES))
    epoch = _epoch(pool, micro_steps)

    def block() -> None:
        for micro, (inputs, targets) in faccel.micro_batches(dist, epoch):
            with faccel.accumulate(dist, model, micro):
                faccel.backward(dist, _loss(model, inputs, targets), micro=micro)
            if micro.sync:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    return block


def with_accelerate(pool: Pool, micro_steps: int) -> Block:
    from accelerate import Accelerator

    accelerator = Accelerator(gradient_accumulation_steps=STEPS)
    model, optimizer, scheduler = accelerator.prepare(*_parts(SIZES))
    epoch = _epoch(pool, micro_steps)

    def block() -> None:
        for inputs, targets in epoch:
            with accelerator.accumulate(model):
                accelerator.backward(_loss(model, inputs, targets))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    return block


def with_fabric(pool: Pool, micro_steps: int) -> Block:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer, scheduler = _parts(SIZES)
    model, optimizer = fabric.setup(model, optimizer)
    epoch = _epoch(pool, micro_steps)

    def block() -> None:
        for i, (inputs, targets) in enumerate(epoch):
            accumulating = (i + 1) % STEPS != 0 and i + 1 != len(epoch)
            with fabric.no_backward_sync(model, enabled=accumulating):
                fabric.backward(_loss(model, inputs, targets) / STEPS)
            if not accumulating:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    return block


MAKERS = {PLAIN: plain, FACCEL: with_faccel, ACCELERATE: with_accelerate, FABRIC: with_fabric}


def run(quick: bool) -> list[Row]:
    torch.set_num_threads(1)
    # Long blocks: the per-micro-step difference is a few microseconds in ~330.
    rounds, micro_steps = (25, 40) if quick else (60, 240)
    pool = batches(SIZES, 32, classes=False)
    installed = anchors()
    blocks = {name: make(pool, micro_steps) for name, make in MAKERS.items() if installed.get(name, True)}
    # per_call times one block; dividing by the micro-steps in it gives time per micro-step.
    timed = {name: functools.partial(per_call, block, 1) for name, block in blocks.items()}
    samples = interleave(timed, rounds=rounds)
    per_micro = {name: [s / micro_steps for s in values] for name, values in samples.items()}
    return rows(
        f"small MLP, {STEPS} micro-steps a step ({micro_steps} micro-steps a block)",
        per_micro,
        baseline=PLAIN,
        unit="us/micro-step",
        scale=1e6,
        goals="accumulation",
    )
