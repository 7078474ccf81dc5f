"""examples/resume.py: stop mid-epoch, resume in a new process, equal weights bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_resume_example_ends_with_the_uninterrupted_weights() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "resume.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "stopped at step 13 (epoch 1, batch 5)" in done.stdout
    assert "restored step-000000000013: step 13, epoch 1, batch 5" in done.stdout
    assert "final weights equal an uninterrupted run's (bitwise, 4 tensors): True" in done.stdout
