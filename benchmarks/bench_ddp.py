"""Two-process DDP over gloo: a training step under faccel vs hand-written DDP.

Two processes are spawned; each starts gloo through ``faccel.detect()`` and trains two
copies of the small MLP on its own batches: one wrapped by hand in
``DistributedDataParallel``, one by ``faccel.prepare``. Blocks of steps alternate
between the two (order rotating), rank 0 times them. Both share the process group, so
the difference is what faccel adds around DDP.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from pathlib import Path

from benchmarks.common import FACCEL, Row, interleave, per_call, rank_env, rows, run_ranks

RAW = "raw DDP"
SIZES = (32, 64, 64, 1)
BATCH = 32


def _worker(rank: int, port: int, plan: tuple[int, int], out: str) -> None:
    os.environ.update(rank_env(rank, port))
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel

    import faccel
    from benchmarks.bench_step import _parts, batches

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    rounds, steps = plan
    dist = faccel.detect()
    pool = batches(SIZES, BATCH, classes=False, seed=1 + rank)
    loss_fn = torch.nn.functional.mse_loss

    def block(model, optimizer, scheduler, backward):  # type: ignore[no-untyped-def]
        data = itertools.cycle(pool)

        def step() -> None:
            inputs, targets = next(data)
            optimizer.zero_grad()
            backward(loss_fn(model(inputs), targets))
            optimizer.step()
            scheduler.step()

        def timed() -> float:
            tdist.barrier()  # both ranks start the block together
            # Wall clock whatever --clock says: waiting for the peer is part of a DDP step.
            return per_call(step, steps, now=time.perf_counter)

        return timed

    raw_model, raw_optimizer, raw_scheduler = _parts(SIZES)
    raw = block(DistributedDataParallel(raw_model), raw_optimizer, raw_scheduler, torch.Tensor.backward)
    model, optimizer, scheduler = faccel.prepare(dist, *_parts(SIZES))
    fac = block(model, optimizer, scheduler, functools.partial(faccel.backward, dist))
    samples = interleave({RAW: raw, FACCEL: fac}, rounds=rounds)
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    faccel.shutdown(dist)


def run(quick: bool) -> list[Row]:
    plan = (15, 30) if quick else (60, 100)
    samples = run_ranks(_worker, plan, what="DDP benchmark")
    return rows(
        f"small MLP {'-'.join(map(str, SIZES))}, batch {BATCH} per rank, 2 gloo processes "
        f"({plan[1]} steps a block)",
        samples,
        baseline=RAW,
        unit="us/step",
        scale=1e6,
        goals="ddp_step",
    )
