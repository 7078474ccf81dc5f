"""The long kill loop of fault-tolerant replicas: 100 SIGKILLs and more, each healed from a live peer.

    PYTHONPATH=. python scripts/prove_ft_kills.py [kills] [seed]   # default 100 kills

Three replicas of a small MLP train on torchft's quorum over gloo (docs/fault-tolerance.md).
Again and again, one replica (drawn) is SIGKILLed after a drawn number of its steps and
restarted; the next kill waits until it has healed and committed a step. At the end every law
of the suite's one-kill test (tests/test_fault_tolerance.py) is checked over the whole run:
one agreed record per committed step, each heal bitwise equal to the survivors' weights, each
sample of every epoch read once, the final weights equal on all replicas and equal, bit for bit,
to a one-process replay of the committed quorums. Prints one JSON line of figures.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time


def main(kills: int, seed: int) -> None:
    from tests.distributed.ft_workers import check_run, kill_run

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        run = kill_run(kills=kills, seed=seed, out=out, timeout=60.0 * kills + 300)
        ran = time.perf_counter() - start
        report = check_run(out, run)
    survivors_restarted = [r for r, codes in run["exitcodes"].items() if len(codes) > 1]
    print(
        json.dumps(
            {
                **report,
                "seed": seed,
                "replicas_killed": survivors_restarted,
                "run_seconds": round(ran),
                "seconds": round(time.perf_counter() - start),
            }
        ),
        flush=True,
    )
    if report["kills"] < kills:
        raise SystemExit(f"only {report['kills']} of {kills} kills happened")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100, int(sys.argv[2]) if len(sys.argv) > 2 else 0)
