"""Where the fault-tolerant step's time goes: faccel's calls timed one by one, beside DDP's step.

python benchmarks/ft_parts.py [STEPS]

The fault-tolerance benchmark's setting (``bench_ft``: the small MLP, batch 32 per replica,
3 gloo processes, each lighthouse wanting all three). Rank 0 times each part of each step,
for ``STEPS`` steps of each loop, three times over: faccel's DDP step (forward, ``backward``
with its all-reduce, the optimizer step), then the fault-tolerant step with a quorum every
step and with ``quorum_every=16`` (``replica_quorum``, forward and backward,
``replica_commit``: the gather, the combine, the commit vote and the optimizer step). It
prints each part's median and mean in microseconds (the mean shows what a quorum every 16
steps costs a step on average). The per-part figures of docs/fault-tolerance.md come from it.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # `python benchmarks/...py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_ft import BATCH, EVERY, SIZES, WORLD, replica
from benchmarks.common import rank_env, run_ranks


def _worker(rank: int, port: int, plan: tuple[int, tuple[str, str]], out: str) -> None:
    os.environ.update(rank_env(rank, port, WORLD))
    import torch
    import torch.distributed as tdist

    import faccel
    from benchmarks.bench_step import _parts, batches

    torch.set_num_threads(1)
    steps, lighthouses = plan
    dist = faccel.detect()
    data = itertools.cycle(batches(SIZES, BATCH, classes=False, seed=1 + rank))
    loss_fn = torch.nn.functional.mse_loss
    times: dict[str, list[float]] = {}
    now = time.perf_counter

    def mark(name: str, since: float) -> float:
        t = now()
        times.setdefault(name, []).append(t - since)
        return t

    model, optimizer, scheduler = faccel.prepare(dist, *_parts(SIZES))
    handles = []
    loops: dict[str, Any] = {}
    for every, lighthouse in zip((1, EVERY), lighthouses, strict=True):
        ft_dist, ft, ft_model, state = replica(rank, every, lighthouse)
        handles.append(ft_dist)
        loops[f"quorum_every={every}"] = (ft, ft_model, {"state": state})

    for _ in range(3):
        tdist.barrier()
        for _ in range(steps):
            inputs, targets = next(data)
            t = now()
            optimizer.zero_grad()
            loss = loss_fn(model(inputs), targets)
            t = mark("DDP: forward", t)
            faccel.backward(dist, loss)
            t = mark("DDP: backward and all-reduce", t)
            optimizer.step()
            scheduler.step()
            mark("DDP: optimizer step", t)
        for name, (ft, ft_model, held) in loops.items():
            tdist.barrier()
            for _ in range(steps):
                inputs, targets = next(data)
                t = now()
                quorum = faccel.replica_quorum(ft, held["state"])
                t = mark(f"{name}: replica_quorum", t)
                loss_fn(ft_model(inputs), targets).backward()
                t = mark(f"{name}: forward and backward", t)
                held["state"] = faccel.replica_commit(ft, quorum)
                mark(f"{name}: replica_commit", t)
    if rank == 0:
        figures = {k: (statistics.median(v) * 1e6, statistics.fmean(v) * 1e6) for k, v in times.items()}
        Path(out).write_text(json.dumps(figures))
    for handle in handles:
        faccel.shutdown(handle)
    faccel.shutdown(dist)


def main(steps: int) -> None:
    os.environ.setdefault("RUST_LOG", "warn")  # before torchft's first import: its servers quiet
    from torchft._torchft import LighthouseServer

    lighthouses = [LighthouseServer(bind="127.0.0.1:0", min_replicas=WORLD) for _ in range(2)]
    try:
        addresses = tuple("http://127.0.0.1:" + lh.address().rsplit(":", 1)[1] for lh in lighthouses)
        figures = run_ranks(_worker, (steps, addresses), what="fault-tolerance parts", world_size=WORLD)
    finally:
        for lighthouse in lighthouses:
            lighthouse.shutdown()
    assert isinstance(figures, dict)
    print(f"{'part (rank 0)':44s} {'median us':>10s} {'mean us':>10s}")
    loops: dict[str, float] = {}
    for name, (median, mean) in figures.items():
        print(f"{name:44s} {median:10.0f} {mean:10.0f}")
        loop = name.split(":")[0]
        loops[loop] = loops.get(loop, 0.0) + mean
    for loop, mean in loops.items():
        print(f"{loop + ': the step (sum of means)':44s} {'':10s} {mean:10.0f}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 320)
