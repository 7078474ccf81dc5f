"""examples/tracking.py runs as documented and leaves a run folder that `python -m faccel plot` draws."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tracking_example_writes_its_run_and_the_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (in the test extra)")
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "examples/tracking.py", str(run)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["metrics"]["loss"] for r in records if "loss" in r["metrics"]]
    assert len(losses) == 48 and losses[-1] < losses[0] / 4
    assert {r["source"] for r in records} == {"mean over 1 rank", "rank 0"}
    assert json.loads((run / "config.json").read_text())["epochs"] == 3
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert f"wrote {run / 'metrics.png'}" in done.stdout
