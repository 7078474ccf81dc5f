"""The long proof of hundreds of one-rank SIGKILLs of DeepSpeed checkpoints.

    PYTHONPATH=. python scripts/prove_gather_kills.py [kills] [seed]   # default 200 kills

Two gloo ranks checkpoint a ZeRO run (stages 2 and 3 in turn) step after step; one of them
(drawn) is SIGKILLed at a random moment, drawn from the first checkpoint's measured duration.
Every survivor must end with a named ``faccel.errors`` exception (never gloo's raw
``RuntimeError``, never a hang), and every root's latest checkpoint must restore whole into a
fresh engine at world size 1 (at the other stage). The suite runs the same loop with a few kills
(tests/test_gather_kills.py, marked ``deepspeed``).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


def main(kills: int, seed: int) -> None:
    # Before the fork server starts: it preloads DeepSpeed, which picks its accelerator on import.
    os.environ["DS_ACCELERATOR"] = "cpu"
    from tests import test_gather_kills

    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as folder:
        result = test_gather_kills.kill_loop(
            Path(folder),
            kills=kills,
            seed=seed,
            report=lambda so_far: print(json.dumps(test_gather_kills.summary(so_far)), flush=True),
        )
    counts = test_gather_kills.summary(result)
    errors = Counter(t["survivor"]["error"] for t in result["trials"] if t["survivor"])
    print(
        json.dumps({**counts, "survivor_errors": dict(errors), "seconds": round(time.perf_counter() - start)})
    )
    raw = [t for t in result["trials"] if not (t["survivor"] and t["survivor"]["named"])]
    for trial in raw[:5]:
        print("not named:", json.dumps(trial)[:1500])
    bad = [r for r in result["restored"] if r["error"] is not None or r["warnings"]]
    for restore in bad[:5]:
        print("bad restore:", json.dumps(restore)[:1500])
    if raw or bad:
        raise SystemExit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, int(sys.argv[2]) if len(sys.argv) > 2 else 0)
