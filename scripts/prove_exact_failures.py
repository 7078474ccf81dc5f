"""The exact-mode failure table: every case of tests/distributed/exact_workers.FAILURES, repeated.

    PYTHONPATH=. python scripts/prove_exact_failures.py [repeats]   # default 3 of each case

On 2 gloo ranks, exact mode (atoms=4, 2 optimizer steps): ``alike`` makes each mistake on both
ranks (another atom count per rank, ``optimizer.zero_grad(set_to_none=False)`` and
``model.zero_grad(set_to_none=False)`` inside a step), each refused by name on both, then trains on;
then rank 1 alone zeroes the gradients in place, skips a backward, or is killed inside a step,
while rank 0 waits in the gradient exchange, or killed between two iterations of ``micro_batches``
while rank 0 agrees on the next one's set-up: rank 1 keeps its own refusal, rank 0 gets a
``RankFailedError`` naming rank 1, never torch's raw gloo error, never a hang (each launch's
timeout: 120 s). Last, rank 1 catches its refusal and lives on (a 5 s process-group timeout): rank
0's wait ends with gloo's timeout, which becomes the same ``RankFailedError``. The suite runs the
first four cases once each (tests/distributed/test_exact.py).
"""

from __future__ import annotations

import sys
import time

from faccel import errors
from tests.distributed import exact_workers, harness


def named(call: str, said: str) -> bool:
    if call in ("told", "taken back"):  # the refusing rank's word in the store, and its withdrawal
        return said == "True"
    return said == "ok" or said.split(":")[0] in errors.__all__


def main(repeats: int) -> None:
    start, bad = time.perf_counter(), 0
    for _ in range(repeats):
        for case in exact_workers.FAILURES:
            lost = (1,) if case.startswith("killed") else ()
            ranks = harness.run(exact_workers.failure, world_size=2, timeout=120, lost=lost, case=case)
            for rank, result in enumerate(ranks):
                for call, said in (result or {"-": "killed"}).items():
                    ok = named(call, said) or (result is None and rank in lost)
                    bad += not ok
                    print(f"{case:<30} rank {rank} {call:<20} {said[:90]}{'' if ok else '   <- NOT NAMED'}")
    seconds = time.perf_counter() - start
    print(f"{repeats * len(exact_workers.FAILURES)} launches, {bad} not named, {seconds:.0f} s")
    if bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
