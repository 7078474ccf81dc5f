"""Every ```python block in README.md and docs/ runs, in order, one namespace per file.

A block preceded by a line ``<!-- not run: reason -->`` is skipped (a fragment,
or a command for a cluster).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"(<!-- not run:[^>]*-->\s*\n)?```python\n(.*?)```", re.S)


def _blocks(path: Path) -> list[str]:
    return [code for skip, code in _BLOCK.findall(path.read_text()) if not skip]


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_python_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"doc_{path.stem}"}
    for number, code in enumerate(_blocks(path), start=1):
        try:
            exec(compile(code, f"{path.name}#block{number}", "exec"), namespace)
        except Exception as error:  # pragma: no cover - the message is the point
            raise AssertionError(f"{path.name} block {number} failed: {error!r}\n{code}") from error


_FENCE = re.compile(r"^(<!-- not run:[^>]*-->\n)?```(\w*)\n", re.M)
# Output, diffs and plain text are shown, not run; every command or program is run or marked.
_SHOWN = {"text", "diff", ""}


@pytest.mark.parametrize("path", DOCS, ids=[p.name for p in DOCS])
def test_every_code_block_is_run_or_marked(path: Path) -> None:
    text = path.read_text()
    opening = [m for m in _FENCE.finditer(text) if text[: m.start()].count("```") % 2 == 0]
    unmarked = [m.group(2) for m in opening if not m.group(1) and m.group(2) not in {"python", *_SHOWN}]
    assert not unmarked, f"{path.name}: {unmarked} blocks are neither run nor marked <!-- not run: ... -->"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    command = re.search(r"The tests .*?```bash\n(.*?)\n```", readme, re.S).group(1).strip()
    assert "pytest -n 2" in command
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines()
