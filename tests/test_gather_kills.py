"""One-rank kills of DeepSpeed checkpoints: every survivor gets a named error, every root restores.

Two real gloo ranks checkpoint a ZeRO run (stage 2 or 3) step after step; the loop SIGKILLs one
of them at a random moment (drawn from the first checkpoint's measured duration, never a fixed
number of seconds). The survivor must end with a ``faccel.errors`` exception (once
14 of 30 survivors got gloo's raw ``Connection reset by peer`` from the whole-state gather), and
the root's latest checkpoint must restore, whole, into a fresh engine.

The suite runs a few kills; ``scripts/prove_gather_kills.py`` runs hundreds through the same code.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import gather_workers, harness

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
]

KILLS = 4
# The kill comes within this many (measured) checkpoints after the first one.
DELAY_IN_CHECKPOINTS = 3.0
# The job's timeout and arrival timeout: a survivor waiting for a dead peer in a check-in waits this.
TIMEOUT_S = 10.0


def _wait_for(paths: list[Path], procs: list[Any], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if all(path.exists() for path in paths):
            return True
        if any(not proc.is_alive() for proc in procs):
            return False
        time.sleep(0.05)
    return False


def kill_trial(root: Path, out: Path, *, stage: int, victim: int, chooser: random.Random) -> dict[str, Any]:
    """One run of 2 ranks checkpointing until rank ``victim`` is SIGKILLed; what the survivor saw."""
    import torch.distributed as tdist

    ctx = mp.get_context("forkserver")
    # DeepSpeed preloaded too where this process starts the fork server (the proof script does,
    # with DS_ACCELERATOR=cpu set first); under pytest the harness's server may already run.
    ctx.set_forkserver_preload([*harness._PRELOAD, "deepspeed"])
    began = time.monotonic()
    store = tdist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
    )
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"root": str(root), "out": str(out), "stage": stage, "timeout_s": TIMEOUT_S}
    procs = [
        ctx.Process(
            target=harness._child,
            args=(gather_workers.checkpoint_until_killed, rank, 2, store.port, str(out), kwargs),
        )
        for rank in range(2)
    ]
    for proc in procs:
        proc.start()
    try:
        ready = [out / f"ready-{rank}" for rank in range(2)]
        if not _wait_for(ready, procs, time.monotonic() + 600):
            return {"setup": "the ranks did not complete a first checkpoint", "survivor": None}
        seconds = max(float(path.read_text()) for path in ready)
        setup = time.monotonic() - began
        time.sleep(chooser.uniform(0, DELAY_IN_CHECKPOINTS * seconds))
        os.kill(procs[victim].pid, signal.SIGKILL)
        killed = time.monotonic()
        survivor = procs[1 - victim]
        survivor.join(4 * TIMEOUT_S + 60)
        hung = survivor.is_alive()
        outcome_path = out / f"outcome-{1 - victim}.json"
        import json

        outcome = json.loads(outcome_path.read_text()) if outcome_path.exists() else None
        return {
            "survivor": outcome,
            "hung": hung,
            "victim": victim,
            "stage": stage,
            "first": seconds,
            "setup_s": round(setup, 1),
            "ended_s": round(time.monotonic() - killed, 1),
        }
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        del store


def kill_loop(folder: Path, *, kills: int, seed: int, batch: int = 10, report: Any = None) -> dict[str, Any]:
    """``kills`` trials (stages 2 and 3 in turn, the victim drawn); after each ``batch`` of them,
    their roots restored at world size 1, each at the other stage; ``report(result)`` then."""
    chooser = random.Random(seed)
    result: dict[str, Any] = {"trials": [], "restored": []}
    for first in range(0, kills, batch):
        numbers = range(first, min(kills, first + batch))
        for number in numbers:
            trial = kill_trial(
                folder / f"root-{number}",
                folder / f"out-{number}",
                stage=(2, 3)[number % 2],
                victim=chooser.randrange(2),
                chooser=chooser,
            )
            result["trials"].append(trial)
        for stage in (2, 3):
            roots = [str(folder / f"root-{n}") for n in numbers if (2, 3)[n % 2] != stage]
            if roots:
                (found,) = harness.run(
                    gather_workers.restore_each,
                    world_size=1,
                    timeout=120 + 30 * len(roots),
                    roots=roots,
                    stage=stage,
                )
                result["restored"] += found
        if report is not None:
            report(result)
    return result


def summary(result: dict[str, Any]) -> dict[str, int]:
    """The counts the proof states: kills, named and raw survivors, hangs, bad restores."""
    trials, restored = result["trials"], result["restored"]
    return {
        "kills": len(trials),
        "named": sum(1 for t in trials if t["survivor"] and t["survivor"]["named"]),
        "raw": sum(1 for t in trials if t["survivor"] and not t["survivor"]["named"]),
        "silent": sum(1 for t in trials if not t["survivor"] and not t.get("hung")),
        "hung": sum(1 for t in trials if t.get("hung")),
        "restored": sum(1 for r in restored if r["error"] is None and not r["warnings"]),
        "bad_restores": sum(1 for r in restored if r["error"] is not None or r["warnings"]),
    }


def test_one_rank_kills_of_deepspeed_checkpoints_leave_every_survivor_named_and_every_root_whole() -> None:
    with tempfile.TemporaryDirectory() as folder:
        result = kill_loop(Path(folder), kills=KILLS, seed=35)
    counts = summary(result)
    raw = [t["survivor"] for t in result["trials"] if t["survivor"] and not t["survivor"]["named"]]
    assert counts["named"] == KILLS, (counts, raw, result["trials"])
    assert counts["bad_restores"] == 0 and counts["restored"] == KILLS, result["restored"]
