"""The pipeline failure table: each mistake and death of tests/distributed/pipeline_workers.FAILURES.

    PYTHONPATH=. python scripts/prove_pipeline_failures.py [repeats]   # default 3 of each case

Each case runs on 2 gloo ranks under ``pipeline=2`` (1F1B, 4 micro-batches): a split naming the
model itself, batches of 10 and 3 rows, a non-scalar loss, a dict output, a loss function or a stage
forward that raises, a weight tied across the stages (split by names, or built by a function),
rank 1 killed inside a step, between two, or between ``forward_backward`` and ``clip_grad_norm``.
A row per case and rank: what it raised. Every rank must end named: a ``faccel.errors`` class, or
the user's own error on the rank where the user's code raised (the peer then names that rank in a
``RankFailedError``); never torch's raw gloo error, never a hang (each launch's timeout: 120 s).
The suite runs the bounded version (tests/distributed/test_pipeline.py: the checks before the
schedule in one launch, a failing last stage, a failing first stage, a kill).
"""

from __future__ import annotations

import sys
import time

from faccel import errors
from tests.distributed import harness, pipeline_workers

# The user's own error, where the user's code raised it (torch wraps a stage's forward's).
OWN = {
    "loss_raises": "ValueError: the user's loss function failed",
    "forward_raises": "[Stage 0] failed to run",
}


def named(case: str, said: str | None) -> bool:
    if said is None:  # the rank that was killed
        return case.startswith("killed")
    return said.split(":")[0] in errors.__all__ or (case in OWN and OWN[case] in said)


def main(repeats: int) -> None:
    start, bad = time.perf_counter(), 0
    print(f"{'case':<22} {'rank 0':<70} rank 1")
    for _ in range(repeats):
        for case in pipeline_workers.FAILURES:
            lost = (1,) if case.startswith("killed") else ()
            ranks = harness.run(pipeline_workers.failures, world_size=2, timeout=120, lost=lost, cases=[case])
            said = [None if r is None else r[case] for r in ranks]
            ok = all(named(case, s) for s in said)
            bad += not ok
            cells = [("-- killed" if s is None else " ".join(s.split()))[:68] for s in said]
            print(f"{case:<22} {cells[0]:<70} {cells[1]}{'' if ok else '   <- NOT NAMED'}", flush=True)
    seconds = time.perf_counter() - start
    print(f"{repeats * len(pipeline_workers.FAILURES)} launches, {bad} not named, {seconds:.0f} s")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
