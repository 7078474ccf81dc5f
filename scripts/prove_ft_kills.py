"""The long kill loop of fault-tolerant replicas: 100 SIGKILLs and more, each healed from a live peer.

    PYTHONPATH=. python scripts/prove_ft_kills.py [kills] [seed] [quorum_every]   # default 100 kills, 1

Three replicas of a small MLP train on torchft's quorum over gloo (docs/fault-tolerance.md).
Again and again, one replica (drawn) is SIGKILLed after a drawn number of its steps and
restarted; the next kill waits until it has healed and committed a step. At the end every law
of the suite's one-kill test (tests/test_fault_tolerance.py) is checked over the whole run:
one agreed record per committed step, each heal bitwise equal to the survivors' weights, each
sample of every epoch read once, the final weights equal on all replicas and equal, bit for bit,
to a one-process replay of the committed quorums; with ``quorum_every`` K above 1, also no run
of more than K committed steps without a quorum. Prints one JSON line of figures.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time


def main(kills: int, seed: int, quorum_every: int = 1) -> None:
    from tests.distributed.ft_workers import check_run, kill_run

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        run = kill_run(kills=kills, seed=seed, out=out, timeout=60.0 * kills + 300, quorum_every=quorum_every)
        ran = time.perf_counter() - start
        report = check_run(out, run, quorum_every=quorum_every)
    survivors_restarted = [r for r, codes in run["exitcodes"].items() if len(codes) > 1]
    print(
        json.dumps(
            {
                **report,
                "seed": seed,
                "quorum_every": quorum_every,
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
    defaults = [100, 0, 1]  # kills, seed, quorum_every
    given = [int(arg) for arg in sys.argv[1:4]]
    main(*given, *defaults[len(given) :])
