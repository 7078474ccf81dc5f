"""The API reference builds from the docstrings with pdoc, without a single warning."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pdoc_builds_the_reference_without_warnings(tmp_path: Path) -> None:
    import faccel

    # -W error: any warning pdoc raises (an annotation it cannot resolve, a broken
    # docstring section...) aborts the build, so a clean exit means no warnings.
    done = subprocess.run(
        [sys.executable, "-W", "error", "-m", "pdoc", "faccel", "--docformat", "google", "-o", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "error"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "Warn" not in done.stderr, done.stderr[-4000:]
    for module, page_path in ((faccel, "faccel.html"), (faccel.func, "faccel/func.html")):
        page = (tmp_path / page_path).read_text()
        names = [name for name in module.__all__ if not inspect.ismodule(getattr(module, name))]
        missing = [name for name in names if f'id="{name}"' not in page]
        assert not missing, f"not in the reference of {module.__name__}: {missing}"
    assert (tmp_path / "faccel" / "errors.html").exists()
