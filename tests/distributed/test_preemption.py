"""Preemption under real torchrun: a stop signal, a SIGKILL and a restart, each ending bitwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "distributed" / "scripts" / "preemptible.py"
# Generous bounds that only a hang reaches; every wait below ends on an event, not a clock.
LIMIT = 240


def _torchrun(root: Path, out: Path, mode: str, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.Popen(
        [*command, *extra, str(SCRIPT), str(root), str(out), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        start_new_session=True,
    )


def _finish(job: subprocess.Popen[str], lines: list[str]) -> str:
    """The rest of ``job``'s output, read through the same file object as ``lines`` were.

    Not ``communicate()``: it reads the pipe's descriptor directly, so whatever the line
    iterator had already buffered (rank 0's stop line, arriving in the same chunk as
    rank 1's) would be lost. Only a hang reaches the watchdog.
    """
    assert job.stdout is not None
    watchdog = threading.Timer(LIMIT, os.killpg, (job.pid, signal.SIGKILL))
    watchdog.start()
    try:
        with job.stdout:
            lines.extend(job.stdout)
        job.wait()
    finally:
        watchdog.cancel()
    return "".join(lines)


def _run(root: Path, out: Path, mode: str, *extra: str) -> tuple[int, str]:
    job = _torchrun(root, out, mode, *extra)
    output = _finish(job, [])
    return job.returncode, output


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("uninterrupted")
    code, output = _run(folder / "ckpt", folder / "weights", "plain")
    assert code == 0, output[-3000:]
    return (folder / "weights").read_text()


def _signal_after_step_7(tmp_path: Path, target: str) -> str:
    """SIGTERM after step 7 of 30 to rank 1 or to the agent; returns the interrupted run's output."""
    root, out = tmp_path / "ckpt", tmp_path / "weights"
    job = _torchrun(root, out, "signal")
    assert job.stdout is not None
    lines: list[str] = []
    pids: dict[str, int] = {}
    sent = 0
    for line in job.stdout:
        lines.append(line)
        words = line.split()
        if line.startswith("rank 1 pid "):
            pids["rank 1"] = int(words[-1])
        if " stopped at step " in line:
            break
        if words[:3] == ["rank", "0" if target == "agent" else "1", "step"]:
            step = int(words[-1])
            # torchrun's agent raises its SignalException wherever its main thread is, and
            # some of its own `except Exception` blocks can swallow it (seen here in 2 of 6
            # runs, and twice in a row under two suites' load): while no rank has stopped, the
            # agent gets the signal again every 3 steps (docs/preemption.md says so).
            if step == 7 or (target == "agent" and sent and step == 7 + 3 * sent and step < 28):
                os.kill(job.pid if target == "agent" else pids["rank 1"], signal.SIGTERM)
                sent += 1
    output = _finish(job, lines)
    stops = sorted(line for line in output.splitlines() if " stopped at step " in line)
    assert len(stops) == 2, output
    steps = {line.split()[-1] for line in stops}
    assert len(steps) == 1 and 7 <= int(steps.pop()) < 30, stops  # the same step on every rank
    return output


def test_sigterm_to_one_rank_checkpoints_every_rank_at_one_step_and_resumes_bitwise(
    tmp_path: Path, uninterrupted: str
) -> None:
    output = _signal_after_step_7(tmp_path, "rank 1")
    assert "exitcode" not in output or "exitcode: 0" in output, output[-3000:]
    code, resumed = _run(tmp_path / "ckpt", tmp_path / "weights", "signal")
    assert code == 0, resumed[-3000:]
    assert "restored step" in resumed
    assert (tmp_path / "weights").read_text() == uninterrupted


def test_sigterm_to_the_torchrun_agent_is_forwarded_and_resumes_bitwise(
    tmp_path: Path, uninterrupted: str
) -> None:
    _signal_after_step_7(tmp_path, "agent")
    code, resumed = _run(tmp_path / "ckpt", tmp_path / "weights", "signal")
    assert code == 0, resumed[-3000:]
    assert (tmp_path / "weights").read_text() == uninterrupted


@pytest.mark.parametrize("mode", ["kill", "kill-background"])
def test_a_sigkilled_rank_is_restarted_by_torchrun_and_ends_bitwise(
    tmp_path: Path, uninterrupted: str, mode: str
) -> None:
    # Rank 1 SIGKILLs itself after step 13 on the first attempt; the agent restarts both
    # workers, which must meet again (their own store keys) and restore the latest checkpoint.
    code, output = _run(tmp_path / "ckpt", tmp_path / "weights", mode, "--max-restarts", "1")
    assert code == 0, output[-3000:]
    assert "restored step" in output, output[-3000:]
    assert (tmp_path / "weights").read_text() == uninterrupted
