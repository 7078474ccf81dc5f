"""Two-process FSDP2 evaluation: a forward without gradients through faccel vs `fully_shard` by hand.

Two gloo processes are spawned. Each rank builds a 4-block MLP (width 64, a ModuleList of
Linear + Tanh blocks, batches of 8) three times: twice sharded by hand (``fully_shard`` on
each block, then on the root, as faccel's default policy does) and once through
``faccel.detect(strategy="fsdp")`` and ``faccel.prepare``; by hand with faccel's default
``reshard_after_forward=True`` on every unit, the root too (torch's default keeps the root's
parameters gathered after its forward: one all-gather fewer per forward, a setting, not a cost
of faccel's). Each is trained one step, then
blocks of forwards under ``torch.no_grad()`` (an evaluation, or generation token by token)
alternate between the three, the order rotating, every rank starting each block together;
rank 0 times them with the wall clock (``run.py --clock cpu``: with rank 0's CPU time, all its
threads, gloo's included, which leaves out the time spent descheduled on a loaded machine
but not the work of a barrier). The second hand-written model's ratio to the first is
the noise floor. faccel's evaluation check-in meets only when a model's forwards change kind
(faccel/_loop/_check_in.py): in steady state, as here, it adds no collective; the first
forward of each evaluation pays one gloo ``monitored_barrier``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from benchmarks.common import FACCEL, Row, interleave, per_call, rank_env, rows, run_ranks

RAW = "fully_shard by hand"
AGAIN = "fully_shard by hand, again"
WIDTH, BLOCKS, BATCH = 64, 4, 8


def _model() -> Any:
    import torch

    class Mlp(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()) for _ in range(BLOCKS)
            )
            self.out = torch.nn.Linear(WIDTH, 1)

        def forward(self, x: Any) -> Any:
            for block in self.blocks:
                x = block(x)
            return self.out(x)

    torch.manual_seed(0)
    return Mlp()


def _by_hand() -> Any:
    from torch.distributed.fsdp import fully_shard

    model = _model()
    # As faccel's prepare does by default (reshard_after_forward=True on every unit, the root too;
    # torch's own default, None, would keep the root's parameters gathered after its forward).
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    return model


def _block(model: Any, inputs: Any, calls: int) -> Any:
    import torch
    import torch.distributed as tdist

    def forward() -> None:
        with torch.no_grad():
            model(inputs)

    def timed() -> float:
        tdist.barrier()
        return per_call(forward, calls)  # run.py --clock cpu: rank 0's CPU time, steadier when loaded

    return timed


def _worker(rank: int, port: int, plan: tuple[int, int], out: str) -> None:
    os.environ.update(rank_env(rank, port))
    import torch

    import faccel

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    rounds, calls = plan
    dist = faccel.detect(strategy="fsdp")
    inputs = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1 + rank))
    models = {RAW: _by_hand(), AGAIN: _by_hand(), FACCEL: faccel.prepare(dist, _model())}
    for model in models.values():  # one training step each: evaluation follows training
        model(inputs).sum().backward()
    blocks = {name: _block(model, inputs, calls) for name, model in models.items()}
    samples = interleave(blocks, rounds=rounds)
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    faccel.shutdown(dist)


def run(quick: bool) -> list[Row]:
    plan = (5, 100) if quick else (20, 400)
    samples: Any = run_ranks(_worker, plan, what="evaluation forward benchmark")
    return rows(
        f"{BLOCKS}-block MLP (width {WIDTH}, batch {BATCH}) under FSDP2, forward under no_grad, "
        f"2 gloo processes ({plan[1]} forwards a block)",
        samples,
        baseline=RAW,
        unit="us/forward",
        scale=1e6,
        goals="eval_forward",
        notes={AGAIN: "the noise floor: the same forward as the baseline, another model"},
    )
