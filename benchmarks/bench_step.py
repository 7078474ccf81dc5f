"""Per-step overhead: a training step under faccel, Accelerate and Fabric vs plain PyTorch.

The setting: one thread, SGD + LambdaLR, the seed's small MLP (32-64-64-1,
batch 32, MSE) and a medium MLP (512-1024-1024-10, batch 64, cross-entropy). Every
subject trains its own copy of the same initial model on the same cycled batches.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from benchmarks.common import ACCELERATE, FABRIC, FACCEL, PLAIN, Row, anchors, interleave, per_call, rows

# A pool of distinct batches, cycled: fresh inputs without paying for randn in the step.
_POOL = 64

Pool = list[tuple[torch.Tensor, torch.Tensor]]
Loss = Callable[..., torch.Tensor]
Step = Callable[[], None]


def mlp(sizes: Sequence[int], *, seed: int = 0) -> nn.Sequential:
    """Linear layers of ``sizes`` with ReLU between them, the same weights for a given seed."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def batches(sizes: Sequence[int], batch: int, *, classes: bool, seed: int = 1) -> Pool:
    """A pool of (inputs, targets): regression targets, or class labels when ``classes``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(_POOL):
        x = torch.randn(batch, sizes[0], generator=g)
        if classes:
            out.append((x, torch.randint(0, sizes[-1], (batch,), generator=g)))
        else:
            out.append((x, torch.randn(batch, 1, generator=g)))
    return out


def _parts(sizes: Sequence[int]) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = mlp(sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    # Slowly decaying, never tiny: the weights stay in float32's normal range.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1.0 + 1e-5 * step))
    return model, optimizer, scheduler


def plain_step(sizes: Sequence[int], pool: Pool, loss_fn: Loss) -> Step:
    model, optimizer, scheduler = _parts(sizes)
    data = itertools.cycle(pool)

    def step() -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()

    return step


def faccel_step(sizes: Sequence[int], pool: Pool, loss_fn: Loss) -> Step:
    import faccel

    dist = faccel.detect({})
    model, optimizer, scheduler = faccel.prepare(dist, *_parts(sizes))
    data = itertools.cycle(pool)

    def step() -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        faccel.backward(dist, loss)
        optimizer.step()
        scheduler.step()

    return step


def accelerate_step(sizes: Sequence[int], pool: Pool, loss_fn: Loss) -> Step:
    from accelerate import Accelerator

    accelerator = Accelerator()
    model, optimizer, scheduler = accelerator.prepare(*_parts(sizes))
    data = itertools.cycle(pool)

    def step() -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()

    return step


def fabric_step(sizes: Sequence[int], pool: Pool, loss_fn: Loss) -> Step:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1)
    model, optimizer, scheduler = _parts(sizes)
    model, optimizer = fabric.setup(model, optimizer)  # Fabric leaves schedulers alone
    data = itertools.cycle(pool)

    def step() -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()

    return step


MAKERS = {PLAIN: plain_step, FACCEL: faccel_step, ACCELERATE: accelerate_step, FABRIC: fabric_step}

# (case, layer sizes, batch, classification, (rounds, steps per block) quick, full).
# Many short blocks rather than a few long ones: each pair of blocks is close in time,
# so a burst of load from elsewhere moves both figures of a pair, not the ratio.
CASES = (
    ("small MLP 32-64-64-1, batch 32", (32, 64, 64, 1), 32, False, (25, 40), (100, 200)),
    ("medium MLP 512-1024-1024-10, batch 64", (512, 1024, 1024, 10), 64, True, (9, 5), (40, 20)),
)


def run(quick: bool) -> list[Row]:
    torch.set_num_threads(1)
    installed = anchors()
    out: list[Row] = []
    for case, sizes, batch, classes, quick_plan, full_plan in CASES:
        rounds, steps = quick_plan if quick else full_plan
        pool = batches(sizes, batch, classes=classes)
        loss_fn = nn.functional.cross_entropy if classes else nn.functional.mse_loss
        subjects = {
            name: make(sizes, pool, loss_fn) for name, make in MAKERS.items() if installed.get(name, True)
        }
        timed = {name: functools.partial(per_call, step, steps) for name, step in subjects.items()}
        samples = interleave(timed, rounds=rounds)
        out += rows(
            f"{case} ({steps} steps a block)",
            samples,
            baseline=PLAIN,
            unit="us/step",
            scale=1e6,
            goals="step",
        )
    return out
