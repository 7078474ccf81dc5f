"""examples/digits.py: >= 95% on the digits test set in one process and two, every test image counted
once, and an interrupted run resumed in a new process ends with the uninterrupted run's weights."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "digits.py"
EPOCHS = "5"  # 0.98 in one process and two here, with a margin over 0.95; the default is 10
TEST_SIZE = 360  # ceil(0.2 * 1797)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
_FINAL = re.compile(r"test accuracy (\d\.\d+) on (\d+) samples \(world size (\d+)\)")
_SHA = re.compile(r"(\d+) steps in [\d.]+ s; weights sha256 ([0-9a-f]{64})")


def _example() -> Any:
    spec = importlib.util.spec_from_file_location("example_digits", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str, torchrun: bool = False) -> str:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else []
    done = subprocess.run(
        [sys.executable, *launcher, str(SCRIPT), "--epochs", EPOCHS, *args],
        capture_output=True,
        text=True,
        timeout=180,
        env=ENV,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def one_process() -> Any:
    """The uninterrupted one-process run, in this process (one thread, as the subprocesses)."""
    import torch

    torch.set_num_threads(1)  # the autouse fixture's setting, which a module fixture runs before
    return _example().main(["--epochs", EPOCHS, "--no-progress"])


def test_one_process_reaches_95_percent_over_exactly_the_test_set(one_process: Any) -> None:
    assert one_process.world_size == 1
    assert one_process.accuracy >= 0.95
    assert one_process.test_samples == TEST_SIZE
    assert (one_process.step, one_process.epoch, one_process.position) == (5 * 45, 5, 0)


def test_two_processes_under_torchrun_reach_95_percent_over_exactly_the_test_set() -> None:
    out = _run(torchrun=True)
    final = _FINAL.findall(out)
    assert len(final) == 1, out  # rank 0 alone reports
    accuracy, samples, world_size = final[0]
    assert float(accuracy) >= 0.95 and int(samples) == TEST_SIZE and world_size == "2", out
    assert "23 batches of 32 per rank per epoch" in out  # 1437 images split between two ranks
    assert _SHA.search(out).group(1) == str(5 * 23), out  # type: ignore[union-attr]


def test_an_interrupted_run_resumed_in_a_new_process_ends_with_the_same_weights(
    one_process: Any, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    stopped = _run("--no-progress", "--checkpoint-dir", str(root), "--stop-after-steps", "100")
    assert f"stopped after step 100 (epoch 2, batch 10); checkpoint {root / 'step-000000000100'}" in stopped
    assert _FINAL.search(stopped) is None  # stopped before the final evaluation
    # keep=2: the end of epoch 1 (step 90) and the interruption (step 100).
    assert sorted(p.name for p in root.iterdir()) == ["step-000000000090", "step-000000000100"]
    interrupted_sha = _SHA.search(stopped).group(2)  # type: ignore[union-attr]
    assert interrupted_sha != one_process.weights_sha256

    resumed = _run("--no-progress", "--checkpoint-dir", str(root), "--resume")
    assert "restored step-000000000100: step 100, epoch 2, batch 10" in resumed
    assert "epoch 1:" not in resumed  # the finished epochs are not trained again
    steps, sha = _SHA.search(resumed).groups()  # type: ignore[union-attr]
    assert (int(steps), sha) == (one_process.step, one_process.weights_sha256)
    (accuracy, samples, world_size), *_ = _FINAL.findall(resumed)
    assert (float(accuracy), int(samples), world_size) == (
        pytest.approx(one_process.accuracy, abs=1e-4),  # printed with 4 decimals
        TEST_SIZE,
        "1",
    )
