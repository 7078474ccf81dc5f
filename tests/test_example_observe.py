"""examples/observe.py under torchrun on 2 processes: a slow rank named, the run drawn."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.budget import example_run

ROOT = Path(__file__).resolve().parents[1]


@example_run
def test_the_observe_example_names_the_slow_rank_and_draws_the_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "examples/observe.py", str(run), "--steps", "20", "--slow-rank", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "rank 1 (host" in done.stdout and "the median" in done.stdout, done.stdout
    assert f"wrote {run / 'metrics.html'}" in done.stdout
    names = {
        n for line in (run / "metrics.jsonl").read_text().splitlines() for n in json.loads(line)["metrics"]
    }
    assert {"perf/mfu", "perf/items_per_second", "memory/peak_gib", "step_time/max"} <= names
    assert {p.name for p in (run / "hangs").iterdir()} == {"rank-00000.json", "rank-00001.json"}
