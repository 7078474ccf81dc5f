"""Every rank of a two-process job exits, and exits cleanly.

1 of 12 two-process runs of examples/run_clm.py never exited on rank 1: after
``shutdown`` destroyed the group, freeing the DDP wrapper joined a gloo worker thread that
waited for the interpreter lock the main thread held. The suite runs a few torchrun jobs of
tests/distributed/scripts/exit_twin.py (run_clm's life cycle without transformers); every one
must exit. ``scripts/prove_exit.py`` runs the same loop (:func:`exit_loop`) 50 times or more,
with run_clm itself or this twin.

A job whose last act is a collective must exit with status 0 too: gloo's worker thread freeing
that collective's tensors while Python finalized aborted the process (SIGABRT) in 3 of 20 jobs
of tests/distributed/scripts/exit_after_collective.py, and once the suite's multi-node rehearsal
(test_resize.py); faccel now lets the workers settle first (faccel/_dist/_settle.py).
``scripts/prove_exit.py --collective`` runs that job 50 times or more.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parents[2]
TWIN = ROOT / "tests" / "distributed" / "scripts" / "exit_twin.py"
COLLECTIVE = ROOT / "tests" / "distributed" / "scripts" / "exit_after_collective.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


@attrs.frozen
class Outcome:
    """One run: whether it exited, its status, its seconds, and what a hung one's processes were doing."""

    exited: bool
    returncode: int | None
    seconds: float
    stacks: str = ""


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (torchrun's agent and its workers), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def _stacks(pids: Sequence[int]) -> str:
    """Each process's native threads' stacks (gdb, where installed): what a hang waits on."""
    out = []
    for pid in pids:
        try:
            done = subprocess.run(
                ["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 12"],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            out.append(f"--- pid {pid}\n{done.stdout[-6000:]}")
        except (OSError, subprocess.TimeoutExpired) as error:
            out.append(f"--- pid {pid}: no stacks ({error})")
    return "\n".join(out)


def run_once(command: Sequence[str], *, deadline_s: float, env: dict[str, str]) -> Outcome:
    """Run ``command`` (a torchrun job) in its own session; past ``deadline_s`` it counts as hung."""
    start = time.monotonic()
    proc = subprocess.Popen(
        list(command),
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        code = proc.wait(timeout=deadline_s)
        return Outcome(exited=True, returncode=code, seconds=time.monotonic() - start)
    except subprocess.TimeoutExpired:
        stacks = _stacks(_tree(proc.pid)[1:])
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return Outcome(exited=False, returncode=None, seconds=time.monotonic() - start, stacks=stacks)


def twin_command(out: Path) -> list[str]:
    """The torchrun command of the twin, writing into ``out``."""
    return [*TORCHRUN, str(TWIN), str(out)]


def collective_command(out: Path) -> list[str]:
    """The torchrun command of a job whose last act is a collective; every other run calls shutdown."""
    shutdown = ["shutdown"] if int(out.name.removeprefix("run")) % 2 else []
    return [*TORCHRUN, str(COLLECTIVE), str(out), *shutdown]


def exit_loop(runs: int, command_for: object = twin_command) -> list[Outcome]:
    """``runs`` two-process jobs, each in a fresh folder; a job that outlives its deadline is hung.

    The deadline is derived from the first job's own duration (four times it, plus a minute),
    so a loaded machine does not turn a slow exit into a hang.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(ROOT)}
    outcomes: list[Outcome] = []
    deadline = 600.0
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(runs):
            out = Path(tmp) / f"run{index}"
            out.mkdir()
            outcome = run_once(command_for(out), deadline_s=deadline, env=env)  # type: ignore[operator]
            if index == 0 and outcome.exited:
                deadline = 4 * outcome.seconds + 60
            outcomes.append(outcome)
    return outcomes


def test_two_process_jobs_exit_after_shutdown_with_their_ddp_wrapper_alive() -> None:
    outcomes = exit_loop(3)
    hung = [o for o in outcomes if not o.exited]
    assert not hung, hung[0].stacks[-8000:]
    assert [o.returncode for o in outcomes] == [0, 0, 0], outcomes


def test_jobs_whose_last_act_is_a_collective_exit_with_status_zero() -> None:
    # Not every run meets the race (about 1 in 7 did before the fix), so the unit test of
    # settle_gloo_workers (tests/test_settle.py) is the deterministic half of this check.
    outcomes = exit_loop(2, collective_command)  # one stopped at exit, one by shutdown
    hung = [o for o in outcomes if not o.exited]
    assert not hung, hung[0].stacks[-8000:]
    assert [o.returncode for o in outcomes] == [0, 0], outcomes


def _ddp_pin() -> dict[str, object]:
    import copy

    import torch

    import faccel
    from faccel._marks import PROCESS_GROUP

    dist = faccel.detect()
    model = faccel.prepare(dist, torch.nn.Linear(2, 1))
    names = list(vars(model))
    pin = vars(model)[PROCESS_GROUP]
    faccel.shutdown(dist)
    return {
        "after the reducer": names.index(PROCESS_GROUP) > names.index("reducer"),
        "holds its group": pin.group is model.process_group,
        "a copy holds none": copy.deepcopy(pin).group is None,
    }


def test_a_ddp_wrapper_holds_its_group_past_its_reducer() -> None:
    # Freeing the wrapper releases its attributes in the order they were set: the pin, set last,
    # is the group's last holder, released by torch without the interpreter lock.
    from tests.distributed import harness

    for outcome in harness.run(_ddp_pin, timeout=60):
        assert outcome == {"after the reducer": True, "holds its group": True, "a copy holds none": True}
