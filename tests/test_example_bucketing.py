"""examples/bucketing.py runs as documented, and with two real processes evaluates every sequence once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_bucketing_example_runs_and_evaluates_every_sequence_once() -> None:
    done = subprocess.run(
        [sys.executable, "examples/bucketing.py", "1"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "300 sequences evaluated" in done.stdout


def test_the_bucketing_example_on_two_ranks_gathers_the_same_count() -> None:
    from tests.distributed import harness

    ranks = harness.run(_two_ranks, world_size=2)
    assert [r["evaluated"] for r in ranks] == [300, 300]
    assert ranks[0]["accuracy"] == ranks[1]["accuracy"]


def _two_ranks() -> dict:
    sys.path.insert(0, str(ROOT / "examples"))
    import bucketing

    return bucketing.main(epochs=1)
