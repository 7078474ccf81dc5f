"""examples/pipeline_loop.py runs as documented: one loop, in one process and as 2 pipeline stages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.budget import example_run

ROOT = Path(__file__).resolve().parents[1]


def _epochs(command: list[str], **env: str) -> list[float]:
    done = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [float(line.rsplit(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("epoch")]


@example_run
def test_the_pipeline_example_prints_the_losses_of_one_process() -> None:
    one = _epochs([sys.executable, "examples/pipeline_loop.py"])
    staged = _epochs(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "examples/pipeline_loop.py"],
        FACCEL_LAYOUT="pipeline=2",
    )  # fmt: skip
    assert len(one) == 3 and staged == pytest.approx(one, rel=1e-5)
