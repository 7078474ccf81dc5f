"""docs/architecture.md stays true: its module map names every module of faccel/, and only those."""

from __future__ import annotations

import ast
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


# A test of which strategy runs: the spellings the loop's and the checkpoints' seams replace.
_STRATEGY_TEST = re.compile(r"dist\.strategy *==|is_deepspeed_engine\(|isinstance\([^)]*PipelinedModel")
# The strategy rooms: the loop's and the checkpoints' (one module or package per strategy each).
_ROOMS = ("faccel/_loop/_strategies/", "faccel/_checkpoint/_strategies/")


def _sources(*folders: str) -> dict[str, str]:
    return {
        path.relative_to(ROOT).as_posix(): path.read_text()
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
    }


def test_nothing_outside_the_strategy_rooms_tests_which_strategy_runs() -> None:
    found = [
        f"{name}:{number}: {line.strip()}"
        for name, text in _sources("faccel/_loop", "faccel/_hf", "faccel/_checkpoint").items()
        if not name.startswith(_ROOMS)
        for number, line in enumerate(text.splitlines(), start=1)
        if _STRATEGY_TEST.search(line)
    ]
    assert found == [], "ask the strategy (faccel._loop._strategies, faccel._checkpoint._strategies):\n" + (
        "\n".join(found)
    )


def _imports(text: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_generic_loop_reaches_the_rooms_only_through_the_table_and_the_protocol() -> None:
    # Rooms import the floor, never the reverse: a generic module imports the table (the package)
    # or the protocol (_base), so that adding a room touches no generic module.
    allowed = {"faccel._loop._strategies", "faccel._loop._strategies._base"}
    found = {
        name: sorted(
            module
            for module in _imports(text)
            if module.startswith("faccel._loop._strategies") and module not in allowed
        )
        for name, text in _sources("faccel/_loop", "faccel/_hf", "faccel/_checkpoint").items()
        if not name.startswith(_ROOMS)
    }
    assert {name: rooms for name, rooms in found.items() if rooms} == {}


def test_a_loop_strategy_is_one_module_and_one_row_of_the_table() -> None:
    from faccel._loop._strategies import LOOP_STRATEGIES
    from faccel._loop._strategies._base import LoopStrategy

    # Every strategy class a room defines is a row of the table, once.
    rooms = _sources("faccel/_loop/_strategies")
    defined = {
        node.name: name
        for name, text in rooms.items()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ClassDef)
        and any(isinstance(base, ast.Name) and base.id == "LoopStrategy" for base in node.bases)
    }
    rows = [type(strategy).__name__ for strategy in LOOP_STRATEGIES]
    assert sorted(rows) == sorted(defined), (rows, defined)
    assert len({strategy.name for strategy in LOOP_STRATEGIES}) == len(rows)
    assert all(isinstance(strategy, LoopStrategy) for strategy in LOOP_STRATEGIES)
    # And the table is the only place that names them: nothing else of faccel lists the rooms.
    table = "faccel/_loop/_strategies/__init__.py"
    elsewhere = {
        f"{name}: {cls}"
        for name, text in _sources("faccel").items()
        for cls, home in defined.items()
        if name not in {table, home} and re.search(rf"\b{cls}\b", text)
    }
    assert elsewhere == set()


# Dotted ``faccel.*`` strings that name no module or object on purpose: format tags, logger names
# and a pytree marker.
_NOT_PATHS = {
    "faccel.checkpoint.state",
    "faccel.checkpoint.rng",
    "faccel.checkpoint.ranks",
    "faccel.fault_tolerance",
    "faccel.static",
    "faccel.sgd",  # docs/functional.md: the names that moved into faccel.func
    "faccel.FunctionalState",
}
_DOTTED = re.compile(r"\bfaccel(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
_MODULE_FILE = re.compile(r"(?<![\w/.])((?:faccel/)?(?:_[A-Za-z0-9_]+/)*_[A-Za-z0-9_]+\.py)")


def _resolves(dotted: str) -> bool:
    import pkgutil

    try:
        pkgutil.resolve_name(dotted)
    except (ImportError, AttributeError, ValueError):
        return False
    return True


def _prose() -> list[Path]:
    code = sorted((ROOT / "faccel").rglob("*.py"))
    return [*code, *sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]


def test_every_faccel_name_the_code_and_docs_cite_exists() -> None:
    """A comment or page that names ``faccel._loop._x.Thing`` names something that is there: a
    module move that left its old name in prose fails here (formerly-names are exempt where the
    class lists them in ``formerly``)."""
    formerly = {
        name
        for path in (ROOT / "faccel").rglob("*.py")
        for listed in re.findall(r"formerly = \(([^)]*)\)", path.read_text())
        for name in re.findall(r'"(faccel\.[\w.]+)"', listed)
    }
    stale = [
        f"{path.relative_to(ROOT)}:{number}: {name}"
        for path in _prose()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for name in (found.rstrip(".") for found in _DOTTED.findall(line))
        if name not in _NOT_PATHS and name not in formerly and not _resolves(name)
    ]
    assert not stale, "\n".join(stale)


def test_every_module_file_the_code_and_docs_cite_exists() -> None:
    modules = [path.relative_to(ROOT).as_posix() for path in (ROOT / "faccel").rglob("*.py")]
    placeholders = {"_strategies/_name.py"}  # docs/architecture.md: the file a new strategy adds
    stale = [
        f"{path.relative_to(ROOT)}:{number}: {cited}"
        for path in _prose()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        for cited in _MODULE_FILE.findall(line)
        if not any(cited.endswith(p) for p in placeholders)
        and not any(module.endswith("/" + cited.removeprefix("faccel/")) for module in modules)
    ]
    assert not stale, "\n".join(stale)
