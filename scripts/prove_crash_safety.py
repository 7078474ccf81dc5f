"""The long proof of crash safety: hundreds of SIGKILLs of ``checkpoint`` and ``save_model``.

    PYTHONPATH=. python scripts/prove_crash_safety.py [kills]   # default 250 of each loop

The suite runs the same loops (tests/test_checkpoint_crash.py, 60 kills of each checkpoint loop;
tests/test_save_model_crash.py, 40 kills) through the same functions; this runs them with many more.
Every kill delay is drawn from a span of writes the loop measures and every deadline from one
measured trial, so the proof holds its meaning on a loaded machine.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from tests import test_checkpoint_crash, test_save_model_crash
from tests.distributed import save_model_workers as sw


def main(kills: int) -> None:
    start = time.perf_counter()
    for replace in (False, True):
        with tempfile.TemporaryDirectory() as root:
            outcomes = test_checkpoint_crash._crash_loop(Path(root), trials=kills, replace=replace, seed=7)
        mid = sum(restored == committed for committed, restored in outcomes)
        what = "replace=True, keep=1" if replace else "new steps, keep=2"
        print(f"checkpoint ({what}): {kills} SIGKILLs ({mid} mid-write), every restore whole")
    with tempfile.TemporaryDirectory() as folder:
        outcomes = test_save_model_crash._crash_loop(Path(folder), trials=kills, seed=7)
    mid = sum(loaded == committed for committed, loaded in outcomes)
    mixed = sum(loaded == sw.MIXED for _, loaded in outcomes)
    print(f"save_model: {kills} SIGKILLs ({mid} mid-save), {mixed} mixed")
    print(f"all loops passed in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 250)
