"""docs/architecture.md stays true: its module map names every module of faccel/, and only those."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_module_map_names_every_module_and_nothing_else() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"^\| `(faccel/[\w/]+\.py)` \|", text, flags=re.MULTILINE))
    modules = {path.relative_to(ROOT).as_posix() for path in (ROOT / "faccel").rglob("*.py")}
    assert named == modules, (
        f"not in the map: {sorted(modules - named)}; in the map but gone: {sorted(named - modules)}"
    )


def test_the_docs_index_links_the_architecture_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "docs/architecture.md" in readme


def test_the_top_level_holds_at_most_ten_modules() -> None:
    """The grouping is in the folders, not only in the docs: the rest lives in packages by layer."""
    top = sorted(path.name for path in (ROOT / "faccel").glob("*.py"))
    assert len(top) <= 10, top


def test_every_package_has_a_docstring_saying_what_it_holds() -> None:
    for init in sorted((ROOT / "faccel").rglob("__init__.py")):
        text = init.read_text().lstrip()
        assert text.startswith('"""') and len(text.split('"""')[1].strip()) > 10, init
