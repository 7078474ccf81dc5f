"""Exact mode's price: a step at 8 atoms vs ordinary DDP at the same global batch, and vs one process.

An MLP of ~9.4M parameters (256-2048-2048-2048-256), global batch 512, AdamW. On 2 and 4 gloo
processes each rank trains two copies side by side on the same batches of a prepared loader:
ordinary faccel DDP (one forward and backward of its 512/W samples, DDP's bucketed all-reduce)
and exact mode (``micro_batches(..., atoms=8, model=model)``: 8/W atoms of 64 samples each, the
fixed tree, the point-to-point exchange). Blocks of steps alternate, the order rotating; rank 0
times them. In one process the same exact step is compared with a plain step of the whole batch.

Bytes sent per rank per step are computed from the sizes, not captured: exact mode's from the
exchange's own plan (recursive halving, then the halves sent back: 2 (W-1)/W of the gradient
bytes); DDP's as a ring all-reduce sends them, the same 2 (W-1)/W.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path

from benchmarks.common import FACCEL, Row, interleave, rank_env, rows, run_ranks

DDP = "ordinary DDP"
PLAIN = "one process, plain"
SIZES = (256, 2048, 2048, 2048, 256)
GLOBAL_BATCH = 512
ATOMS = 8


def _parts():  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(SIZES):
        layers += [nn.Linear(a, b), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _worker(rank: int, port: int, plan: tuple[int, int, int], out: str) -> None:
    world, rounds, steps = plan
    os.environ.update(rank_env(rank, port, world))
    import torch
    import torch.distributed as tdist
    from torch.utils.data import DataLoader, TensorDataset

    import faccel

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist = faccel.detect()
    generator = torch.Generator().manual_seed(0)
    samples = GLOBAL_BATCH * steps
    inputs = torch.randn(samples, SIZES[0], generator=generator)
    data = TensorDataset(inputs, torch.randn(samples, SIZES[-1], generator=generator))
    raw = DataLoader(data, batch_size=GLOBAL_BATCH // world, drop_last=True)
    loss_fn = torch.nn.functional.mse_loss

    ordinary_model, ordinary_optimizer, loader = faccel.prepare(dist, *_parts(), raw)
    exact_model, exact_optimizer = faccel.prepare(dist, *_parts())
    epochs = itertools.count()

    def wait() -> None:
        if dist.distributed:
            tdist.barrier()  # every rank starts the block together

    def ordinary() -> float:
        view = loader.at(epoch=next(epochs))
        wait()
        start = time.perf_counter()
        for inputs, targets in view:
            ordinary_optimizer.zero_grad()
            faccel.backward(dist, loss_fn(ordinary_model(inputs), targets))
            ordinary_optimizer.step()
        return (time.perf_counter() - start) / steps

    def exact() -> float:
        view = loader.at(epoch=next(epochs))
        wait()
        start = time.perf_counter()
        for micro, (inputs, targets) in faccel.micro_batches(dist, view, atoms=ATOMS, model=exact_model):
            with faccel.accumulate(dist, exact_model, micro):
                faccel.backward(dist, loss_fn(exact_model(inputs), targets), micro=micro)
            if micro.sync:
                exact_optimizer.step()
        return (time.perf_counter() - start) / steps

    figures = interleave({DDP if world > 1 else PLAIN: ordinary, FACCEL: exact}, rounds=rounds)
    if rank == 0:
        Path(out).write_text(json.dumps(figures))
    faccel.shutdown(dist)


def _bytes(world: int) -> tuple[float, float]:
    """MB each rank sends per step: exact mode's exchange (from its plan), and a ring all-reduce's."""
    from faccel._loop._tree_reduce import plan

    numel = sum(a * b + b for a, b in itertools.pairwise(SIZES))
    exact = sum(r.give[1] - r.give[0] for r in plan(0, world, numel)) * 4 + len(plan(0, world, 1)) * 8
    ring = 2 * (world - 1) / world * numel * 4
    return exact / 1e6, ring / 1e6


def run(quick: bool) -> list[Row]:
    rounds, steps = (3, 2) if quick else (5, 3)
    out: list[Row] = []
    for world in (1, 2, 4):
        figures = run_ranks(_worker, (world, rounds, steps), what="exact-mode benchmark", world_size=world)
        baseline = DDP if world > 1 else PLAIN
        if world > 1:
            sent, ring = _bytes(world)
            notes = {FACCEL: f"sends {sent:.1f} MB/step per rank", DDP: f"ring all-reduce {ring:.1f} MB/step"}
            case = f"~9.4M-param MLP, global batch {GLOBAL_BATCH}, {world} gloo processes, atoms={ATOMS}"
        else:
            notes = {FACCEL: f"{ATOMS} atoms of {GLOBAL_BATCH // ATOMS} in one process"}
            case = f"~9.4M-param MLP, global batch {GLOBAL_BATCH}, one process, atoms={ATOMS}"
        out += rows(
            case,
            figures,  # type: ignore[arg-type]
            baseline=baseline,
            unit="ms/step",
            scale=1e3,
            goals="exact_step" if world > 1 else None,
            notes=notes,
        )
    return out
