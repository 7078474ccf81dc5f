"""examples/moe_loop.py runs as documented: one loop, in one process and with its experts split over 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.budget import example_run

ROOT = Path(__file__).resolve().parents[1]


def _epochs(command: list[str], **env: str) -> list[str]:
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
    return [line for line in done.stdout.splitlines() if line.startswith("epoch")]


@example_run
def test_the_moe_example_prints_the_losses_and_loads_of_one_process() -> None:
    one = _epochs([sys.executable, "examples/moe_loop.py"])
    split = _epochs(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "examples/moe_loop.py"],
        FACCEL_LAYOUT="expert=2",
    )  # fmt: skip
    assert len(one) == 3 and [line.rsplit(" loss ", 1)[0] for line in split] == [
        line.rsplit(" loss ", 1)[0] for line in one
    ]
    losses = [[float(line.rsplit(" ", 1)[1]) for line in lines] for lines in (one, split)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
