"""faccel's modules import one another without a cycle.

The graph is read from the source with ``ast``, not by importing: an edge
``a -> b`` for every ``import faccel.b`` / ``from faccel.b import ...`` /
``from faccel import b`` / relative import in module ``a``, wherever it sits,
function-local imports included (a lazy import is still a dependency, and
a cycle through one is the kind this test exists to catch). Only imports under
``if TYPE_CHECKING:`` are left out: they never run. Packages (a directory
with ``__init__.py``) are nodes like modules; importing ``faccel.pkg.mod``
also runs ``faccel`` and ``faccel.pkg``, so it adds an edge to each package
on the way, except the importer's own packages, which have run before it.
``faccel/__init__.py`` itself imports its modules with
``importlib`` on first attribute access (PEP 562), which is no import
statement: it has no edges out, so it closes no cycle.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "faccel"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement under ``node``, skipping the bodies of ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for other in child.orelse:  # the else branch does run
                yield from _imports_of(other)
            continue
        yield from _imports_of(child)


def _imports_of(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
    else:
        yield from _imports(node)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def _with_parents(name: str, modules: set[str]) -> set[str]:
    """``name`` and each package it lives in (importing it runs them), known modules only."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts) + 1)} & modules


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the package at ``root`` that it imports."""
    files = {_module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in _imports(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    targets |= _with_parents(alias.name, modules)
                continue
            base = _resolve(name, is_package, node)
            targets |= _with_parents(base, modules)
            for alias in node.names:  # from faccel import errors, from faccel.pkg import mod
                if f"{base}.{alias.name}" in modules:
                    targets.add(f"{base}.{alias.name}")
        # A module's own packages are imported before it runs, so they are no dependency of
        # it: a package's __init__ re-exporting from its modules is no cycle.
        graph[name] = targets - {name} - _with_parents(name, modules)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; faccel's graph is shallow
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, set(component)) for component in components]


def _cycle_in(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:  # breadth first: the shortest way back to start within the component
        nxt_frontier = []
        for node in frontier:
            for nxt in sorted(graph[node] & component):
                if nxt == start:
                    return [*paths[node], start]
                if nxt not in paths:
                    paths[nxt] = [*paths[node], nxt]
                    nxt_frontier.append(nxt)
        frontier = nxt_frontier
    raise AssertionError(component)  # pragma: no cover - a component always closes


def test_faccel_has_no_import_cycle() -> None:
    graph = import_graph(PACKAGE)
    assert "faccel._dist._state" in graph and "faccel._dist._process_group" in graph
    cycles = find_cycles(graph)
    assert not cycles, "import cycles in faccel/:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_state_is_pure_and_the_process_group_builds_on_it() -> None:
    graph = import_graph(PACKAGE)
    assert "faccel._dist._state" in graph["faccel._dist._process_group"]
    assert "faccel._dist._process_group" not in graph["faccel._dist._state"]


def _layers() -> dict[str, int]:
    """docs/architecture.md's layer table: top-level package or module -> its layer."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    layers: dict[str, int] = {}
    for row in re.findall(r"^\| (\d+) \| (.+) \|$", section, flags=re.MULTILINE):
        for name in re.findall(r"`([\w.]+)`", row[1]):
            layers["faccel" if name == "faccel" else f"faccel.{name}"] = int(row[0])
    return layers


def _unit(module: str) -> str:
    """The top-level package or module ``module`` belongs to: ``faccel._dist._mesh`` -> ``faccel._dist``."""
    return ".".join(module.split(".")[:2])


def test_every_top_level_unit_has_a_layer() -> None:
    layers = _layers()
    units = {_unit(module) for module in import_graph(PACKAGE)}
    assert units == set(layers), (
        f"no layer in docs/architecture.md: {sorted(units - set(layers))}; "
        f"gone: {sorted(set(layers) - units)}"
    )


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    layers = _layers()
    upward = [
        f"{module} (layer {layers[_unit(module)]}) imports {target} (layer {layers[_unit(target)]})"
        for module, targets in import_graph(PACKAGE).items()
        for target in sorted(targets)
        if _unit(target) != _unit(module) and layers[_unit(target)] > layers[_unit(module)]
    ]
    assert not upward, "upward imports:\n" + "\n".join(upward)


# The modules docs/architecture.md calls pure, and the ones that start or talk to processes.
PURE = (
    "faccel._dist._state",
    "faccel._dist._launch",
    "faccel._dist._layout",
    "faccel._data._sharding",
    "faccel._data._split",
    "faccel._data._samplers",
    "faccel._loop._micro_step",
)
PROCESSES = (
    "faccel._dist._process_group",
    "faccel._dist._mesh",
    "faccel._dist._collectives",
    "faccel._dist._consensus",
)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.get(todo.pop(), ()):
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


@pytest.mark.parametrize("module", PURE)
def test_a_pure_module_reaches_nothing_that_starts_processes(module: str) -> None:
    graph = import_graph(PACKAGE)
    assert module in graph
    reached = _reachable(graph, module) & set(PROCESSES)
    assert not reached, f"{module} imports, directly or not, {sorted(reached)}"


def test_the_layer_check_finds_an_upward_import(tmp_path: Path) -> None:
    """The check above can fail: a storage module importing the loop is caught."""
    pkg = tmp_path / "faccel"
    for relative, text in {
        "__init__.py": "",
        "_storage/__init__.py": "",
        "_storage/_w.py": "from faccel._loop._model import unwrap_model\n",
        "_loop/__init__.py": "",
        "_loop/_model.py": "",
    }.items():
        (pkg / relative).parent.mkdir(parents=True, exist_ok=True)
        (pkg / relative).write_text(text)
    layers = _layers()
    graph = import_graph(pkg)
    found = [
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if _unit(target) != _unit(module) and layers[_unit(target)] > layers[_unit(module)]
    ]
    assert sorted(found) == [
        ("faccel._storage._w", "faccel._loop"),
        ("faccel._storage._w", "faccel._loop._model"),
    ]


_CASES = {
    "a top-level cycle": (
        {"a.py": "from pkg import b\n", "b.py": "import pkg.a\n"},
        [["pkg.a", "pkg.b", "pkg.a"]],
    ),
    "a cycle through a function-local import": (
        {"a.py": "from pkg.b import f\n", "b.py": "def f():\n    from pkg.a import g\n"},
        [["pkg.a", "pkg.b", "pkg.a"]],
    ),
    "TYPE_CHECKING imports never run": (
        {
            "a.py": "from pkg.b import f\n",
            "b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import g\n",
        },
        [],
    ),
    "a subpackage, a relative import and its __init__": (
        {
            "a.py": "from pkg.sub.c import h\n",
            "sub/__init__.py": "from .c import h\n",
            "sub/c.py": "from ..a import x\n",
        },
        [["pkg.a", "pkg.sub.c", "pkg.a"]],  # the shortest way round; pkg.sub is on another
    ),
    "no cycle in a chain": (
        {"a.py": "import pkg.b\n", "b.py": "from pkg import c\n", "c.py": "import os\n"},
        [],
    ),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_the_graph_finds_the_cycles_it_should(case: str, tmp_path: Path) -> None:
    files, expected = _CASES[case]
    root = tmp_path / "pkg"
    for relative, text in {"__init__.py": "", **files}.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    cycles = find_cycles(import_graph(root))
    # A cycle may be reported from any of its members; compare as rotations of one loop.
    assert [sorted(c[:-1]) for c in cycles] == [sorted(c[:-1]) for c in expected]
    for cycle in cycles:
        assert cycle[0] == cycle[-1]


def test_importing_a_module_of_a_subpackage_runs_the_packages_on_the_way(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    for relative, text in {
        "__init__.py": "",
        "a.py": "from pkg.sub.c import h\nfrom . import b\n",
        "b.py": "",
        "sub/__init__.py": "",
        "sub/c.py": "",
    }.items():
        (root / relative).write_text(text)
    # pkg itself has run before pkg.a does: no edge to it
    assert import_graph(root)["pkg.a"] == {"pkg.sub", "pkg.sub.c", "pkg.b"}


def test_a_package_re_exporting_its_modules_is_no_cycle_but_a_loop_through_it_is(tmp_path: Path) -> None:
    root = tmp_path / "pkg"
    (root / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "",
        "sub/__init__.py": "from pkg.sub.c import h\n",
        "sub/c.py": "from pkg.sub.d import k\n",
        "sub/d.py": "",
    }
    for relative, text in files.items():
        (root / relative).write_text(text)
    assert find_cycles(import_graph(root)) == []
    (root / "sub/d.py").write_text("from pkg.a import x\n")
    (root / "a.py").write_text("from pkg.sub import h\n")  # a -> sub -> c -> d -> a
    cycles = find_cycles(import_graph(root))
    assert len(cycles) == 1 and {"pkg.a", "pkg.sub.d"} <= set(cycles[0])
