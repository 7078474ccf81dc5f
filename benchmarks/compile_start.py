"""What torch.compile costs at start with faccel: the first step (the compilation) and the steps after.

    python benchmarks/compile_start.py [--backends aot_eager inductor] [--steps 100]

The seed's small MLP (32-64-64-1, batch 32, SGD), one thread, prepared by faccel and then compiled;
the eager loop is timed beside it. A standalone script, not part of ``run.py``'s registry: the
inductor backend's first step alone takes tens of seconds on a small CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# A cold start, as a fresh machine sees it: inductor's on-disk caches would hide the build.
# (--warm-cache measures a second run on the same machine.)
if "--warm-cache" not in sys.argv:
    os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import faccel


def measure(backend: str | None, steps: int) -> tuple[float, float]:
    """(first step in seconds, median of the later steps in microseconds)."""
    dist = faccel.detect({})
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    model.append(torch.nn.ReLU()).append(torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    if backend is not None:
        model = torch.compile(model, backend=backend)
    x, y = torch.randn(32, 32), torch.randn(32, 1)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        times.append(time.perf_counter() - start)
    later = sorted(times[1:])
    return times[0], later[len(later) // 2] * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="*", default=["aot_eager", "inductor"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--warm-cache", action="store_true", help="let inductor reuse its on-disk cache")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, one thread, {args.steps} steps after the first")
    print(f"{'subject':<12} {'first step':>12} {'later steps (median)':>22}")
    for backend in [None, *args.backends]:
        first, later = measure(backend, args.steps)
        print(f"{backend or 'eager':<12} {first:>10.2f} s {later:>17.0f} us/step")


if __name__ == "__main__":
    main()
