"""Functional training: sync_grads vs hand-written collectives, and a functional step vs nn.Module.

python benchmarks/run.py --only functional        # through the registry (rows, docs)
python benchmarks/bench_functional.py [--quick]   # alone, printing the rows

1. ``faccel.func.sync_grads`` over 100 float32 gradient tensors (0.8 MB and 13 MB in all:
   50 weight matrices and 50 bias vectors), two gloo processes spawned here (the
   parent hosts the TCPStore on a port the OS picks). The issue's two ways of averaging
   100 tensors by hand are timed beside it: one ``all_reduce`` per tensor, and one flat
   ``all_reduce`` (one flat bucket per dtype with ``torch.cat``: cat ->
   divide -> one ``all_reduce`` -> split and view back), the baseline. Target: sync_grads
   <= 1.2x the one flat all_reduce. Also timed, for context: a bare ``all_reduce`` of a
   buffer that is already flat (no copy, no division: a floor no way of averaging 100
   separate tensors reaches), the same floor plus one in-place pass over the buffer
   (what the unavoidable copy costs at least, on this machine), sync_grads as one
   bucket per dtype, sync_grads reusing its buffers (``grad_buckets``) and, to compare
   that with, the flat approach by hand into a buffer it reuses. Each row's
   note gives its median ratio to the floor. Rank 0's wall clock; every block starts
   at a barrier.
2. One training step of the small MLP (32-64-64-1, batch 32, one thread, MSE, SGD):
   ``loss_and_grad`` + ``FunctionalState.apply_gradients`` vs ``zero_grad`` / forward /
   ``backward`` / ``optimizer.step`` on the module; also the step written by hand with
   ``torch.func.functional_call`` + ``torch.autograd.grad``, which shows what
   ``functional_call`` costs by itself. Target: <= 1.2.

Subjects run in interleaved rounds (benchmarks/common.py), so a slow period of the
shared machine hits them alike; rows give medians and the median of per-round ratios.
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs

# Run as a script (and in its spawned children), only this folder is on the path.
if str(Path(__file__).resolve().parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import FACCEL, Row, interleave, per_call, rank_env, rows, run_ranks

TARGET = 1.2
TENSORS = 100
FLAT = "one flat all_reduce, by hand (cat, divide, all_reduce, split)"
FLOOR = "all_reduce of an already flat buffer (floor)"
TOUCHED = "floor + one in-place pass over the buffer"
PER_TENSOR = "all_reduce per tensor"
BUCKETS = "faccel, bucket_cap_mb=None (one bucket)"
REUSED = "faccel, reused buckets (grad_buckets)"
FLAT_REUSED = "one flat all_reduce, by hand, into a reused buffer"
MODULE = "nn.Module step"
FUNC_BY_HAND = "torch.func step, by hand"


def _shapes(total_floats: int) -> list[tuple[int, ...]]:
    """50 (rows, width) weights and 50 (rows,) biases, about ``total_floats`` in all."""
    layers = TENSORS // 2
    width = int((total_floats / layers) ** 0.5)
    shapes: list[tuple[int, ...]] = []
    for k in range(layers):
        rows_ = max(1, width + (k % 5 - 2) * width // 10)
        shapes += [(rows_, width), (rows_,)]
    return shapes


def _sync_worker(rank: int, port: int, plan: dict[str, Any], out: str) -> None:
    import torch
    import torch.distributed as tdist

    import faccel

    torch.set_num_threads(1)
    dist = faccel.detect(rank_env(rank, port))
    world = dist.world_size
    results = {}
    for size_mb, calls in plan["sizes"]:
        g = torch.Generator().manual_seed(rank)
        grads = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(_shapes(int(size_mb * 1e6 / 4)))}
        leaves = list(grads.values())
        # Zeros: summed again and again, they stay finite (random values would reach inf).
        flat = torch.zeros(sum(t.numel() for t in leaves))

        def per_tensor(leaves: list = leaves) -> None:
            for t in leaves:
                t.div_(world)  # keeps the values' scale steady across calls
                tdist.all_reduce(t)

        def flat_by_hand(leaves: list = leaves) -> list:
            buffer = torch.cat([t.reshape(-1) for t in leaves]).div_(world)
            tdist.all_reduce(buffer)
            chunks = buffer.split([t.numel() for t in leaves])
            return [c.view(t.shape) for c, t in zip(chunks, leaves, strict=True)]

        def block(fn: Any, calls: int = calls) -> Any:
            def timed() -> float:
                tdist.barrier()  # both ranks start together
                return per_call(fn, calls, now=time.perf_counter)

            return timed

        buckets = faccel.func.grad_buckets(dist, grads)
        reused = torch.empty(sum(t.numel() for t in leaves))

        def flat_reused(leaves: list = leaves, buffer: Any = reused) -> list:
            torch.cat([t.reshape(-1) for t in leaves], out=buffer).div_(world)
            tdist.all_reduce(buffer)
            chunks = buffer.split([t.numel() for t in leaves])
            return [c.view(t.shape) for c, t in zip(chunks, leaves, strict=True)]

        def touched(flat: Any = flat) -> None:
            flat.mul_(1.0)
            tdist.all_reduce(flat)

        subjects = {
            FLAT: block(flat_by_hand),
            FACCEL: block(lambda grads=grads: faccel.func.sync_grads(dist, grads)),
            BUCKETS: block(lambda grads=grads: faccel.func.sync_grads(dist, grads, bucket_cap_mb=None)),
            REUSED: block(lambda grads=grads, b=buckets: faccel.func.sync_grads(dist, grads, buckets=b)),
            FLAT_REUSED: block(flat_reused),
            PER_TENSOR: block(per_tensor),
            FLOOR: block(lambda flat=flat: tdist.all_reduce(flat)),
            TOUCHED: block(touched),
        }
        results[str(size_mb)] = interleave(subjects, rounds=plan["rounds"])
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    faccel.shutdown(dist)


def bench_sync(quick: bool) -> list[Row]:
    plan = {"sizes": [(0.8, 10), (13.0, 2)], "rounds": 10 if quick else 40}
    results = run_ranks(_sync_worker, plan, what="sync_grads benchmark")
    found = []
    for size_mb, calls in plan["sizes"]:
        case = f"sync_grads, {TENSORS} float32 tensors, {size_mb:g} MB, 2 gloo processes"
        case += f" ({calls} calls a block)"
        samples = results[str(size_mb)]
        # How far each way of averaging 100 tensors is from the floor that none reaches.
        floor = samples[FLOOR]
        to_floor = {
            name: statistics.median(a / b for a, b in zip(samples[name], floor, strict=True))
            for name in (FLAT, FACCEL, BUCKETS, REUSED, FLAT_REUSED, TOUCHED)
        }
        notes = {name: f"{ratio:.2f}x the floor" for name, ratio in to_floor.items()}
        found += rows(case, samples, baseline=FLAT, unit="ms/call", scale=1e3, notes=notes)
    return found


def bench_step(quick: bool) -> list[Row]:
    import torch
    from torch import nn

    import faccel
    from benchmarks.bench_step import batches, mlp

    sizes, lr, steps = (32, 64, 64, 1), 1e-3, 50 if quick else 200
    pool = batches(sizes, 32, classes=False)
    loss_fn = nn.functional.mse_loss
    dist = faccel.detect({})

    model = mlp(sizes)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    module_data = itertools.cycle(pool)

    def module_step() -> None:
        x, y = next(module_data)
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()

    template = mlp(sizes)
    params, buffers = faccel.func.model_params(dist, template)
    grad_fn = faccel.func.loss_and_grad(dist, template, loss_fn)
    box = [faccel.func.FunctionalState.create(params=params, buffers=buffers, optimizer=faccel.func.sgd(lr))]
    func_data = itertools.cycle(pool)

    def functional_step() -> None:
        x, y = next(func_data)
        state = box[0]
        _, grads = grad_fn(state.params, state.buffers, x, y)
        box[0] = state.apply_gradients(grads)

    raw = [dict(params)]
    raw_data = itertools.cycle(pool)

    def by_hand_step() -> None:
        x, y = next(raw_data)
        live = {k: v.detach().requires_grad_() for k, v in raw[0].items()}
        loss = loss_fn(torch.func.functional_call(template, live, (x,)), y)
        grads = torch.autograd.grad(loss, tuple(live.values()))
        with torch.no_grad():
            raw[0] = {k: p.add(g, alpha=-lr) for (k, p), g in zip(live.items(), grads, strict=True)}

    subjects = {
        MODULE: lambda: per_call(module_step, steps),
        FACCEL: lambda: per_call(functional_step, steps),
        FUNC_BY_HAND: lambda: per_call(by_hand_step, steps),
    }
    samples = interleave(subjects, rounds=10 if quick else 40)
    case = f"training step, small MLP 32-64-64-1, batch 32, SGD ({steps} steps a block)"
    return rows(case, samples, baseline=MODULE, unit="us/step", scale=1e6)


def run(quick: bool) -> list[Row]:
    found = bench_sync(quick) + bench_step(quick)
    return [attrs.evolve(row, target=TARGET) if row.subject == FACCEL else row for row in found]


def main() -> None:
    import os

    import torch

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    for row in run(quick="--quick" in sys.argv):
        compared = "" if row.median is None else f"  {row.median:6.2f}x {row.baseline}"
        mark = "" if row.met is None else ("  (target met)" if row.met else f"  (target {row.target})")
        print(f"{row.case[:60]:60s} {row.subject:34s} {row.value:10.3f} {row.unit}{compared}{mark}")


if __name__ == "__main__":
    main()
