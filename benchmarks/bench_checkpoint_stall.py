"""Training stall of a non-blocking checkpoint: ``checkpoint(..., blocking=False)`` vs a blocking one.

The setting of ``bench_checkpoint.py``: an MLP of ~50M parameters with AdamW
state, 604 MB, in one process. The stall is how long the call keeps the
training loop from going on: for a blocking checkpoint, the whole write and
commit; for a non-blocking one, the host copy of the state and the planning
(the write, the fsyncs and the commit then run on a background thread). After
each non-blocking call the loop runs one training step (what the thread
competes with), then waits for the commit (untimed) before the next round.
Rounds alternate the two subjects; each figure is a median.

    python benchmarks/bench_checkpoint_stall.py            # 604 MB, 5 rounds
    python benchmarks/bench_checkpoint_stall.py --quick    # 44 MB, 3 rounds
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_checkpoint import SIZES, _setup


def main(argv: list[str] | None = None) -> int:
    import faccel
    from faccel._checkpoint._background import wait

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist, state, model = _setup(args.quick)
    width = SIZES[args.quick][0]
    rounds = 3 if args.quick else 5
    work = Path(tempfile.mkdtemp(prefix="faccel-stall-"))
    blocking, stall, step = [], [], 0
    try:
        for _ in range(rounds):
            for mode in ("blocking", "background"):
                shutil.rmtree(work / "root", ignore_errors=True)
                step += 1
                start = time.perf_counter()
                faccel.checkpoint(
                    dist, attrs.evolve(state, step=step), work / "root", blocking=mode == "blocking"
                )
                (blocking if mode == "blocking" else stall).append(time.perf_counter() - start)
                model(torch.randn(2, width)).sum().backward()  # training goes on beside the thread
                state.optimizer.step()
                state.optimizer.zero_grad(set_to_none=True)
                wait(dist.runtime)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    b, s = statistics.median(blocking), statistics.median(stall)
    print(f"blocking checkpoint: {b:.3f} s; non-blocking stall: {s:.3f} s; stall / blocking: {s / b:.2f}")
    print(f"  blocking {[round(x, 3) for x in blocking]}; stall {[round(x, 3) for x in stall]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
