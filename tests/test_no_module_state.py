"""No module-level mutable state in ``faccel/``: an AST scan of every module.

The law: no module-level name is bound to a mutable container (a list, dict or set display, a
call of ``list``/``dict``/``set``/``defaultdict``/``deque``/``OrderedDict``/``WeakKeyDictionary``/
``WeakValueDictionary``/``WeakSet``) or to ``None`` while a function of that module mutates it
(a mutating method call, an item or attribute assignment, ``del`` of an item) or rebinds it
(``global``). What a process owns lives in its runtime handle (``faccel._dist._runtime``) instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "faccel"

_CONTAINER_CALLS = frozenset(
    {
        "list",
        "dict",
        "set",
        "bytearray",
        "defaultdict",
        "deque",
        "OrderedDict",
        "Counter",
        "WeakKeyDictionary",
        "WeakValueDictionary",
        "WeakSet",
    }
)
_MUTATORS = frozenset(
    {
        "append",
        "extend",
        "insert",
        "pop",
        "popitem",
        "remove",
        "clear",
        "update",
        "setdefault",
        "add",
        "discard",
        "appendleft",
        "popleft",
        "sort",
        "reverse",
        "__setitem__",
        "__delitem__",
    }
)


def _mutable_value(node: ast.expr | None) -> bool:
    if node is None:
        return False
    if isinstance(node, ast.List | ast.Dict | ast.Set | ast.ListComp | ast.DictComp | ast.SetComp):
        return True
    if isinstance(node, ast.Constant) and node.value is None:
        return True
    if isinstance(node, ast.Call):
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        return name in _CONTAINER_CALLS
    return False


def _module_names(tree: ast.Module) -> set[str]:
    """Module-level names bound to a mutable container or None."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _mutable_value(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and _mutable_value(node.value)
        ):
            names.add(node.target.id)
    return names


def _root_name(node: ast.expr) -> str | None:
    while isinstance(node, ast.Subscript | ast.Attribute | ast.Call):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def problems_in(source: str, where: str) -> list[str]:
    """Each module-level mutable name that a function of ``source`` mutates or rebinds."""
    tree = ast.parse(source)
    names = _module_names(tree)
    found: list[str] = []
    for function in ast.walk(tree):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                found += [f"{where}: `global {name}` in a function" for name in node.names]
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in _MUTATORS and _root_name(node.func.value) in names:
                    found.append(f"{where}: {_root_name(node.func.value)}.{node.func.attr}(...)")
            elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
                targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Subscript | ast.Attribute) and _root_name(target) in names:
                        found.append(f"{where}: {_root_name(target)}[...] written")
    return found


def test_no_module_level_mutable_state_in_faccel() -> None:
    found: list[str] = []
    for path in sorted(ROOT.rglob("*.py")):
        found += problems_in(path.read_text(), str(path.relative_to(ROOT.parent)))
    assert found == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("_PENDING = []\ndef f(x):\n    _PENDING.append(x)\n", 1),
        ("_MADE: dict = {}\ndef f(k, v):\n    _MADE[k] = v\n", 1),
        ("_HOOKS = list()\ndef f():\n    _HOOKS.clear()\n", 1),
        ("_ONE = None\ndef f():\n    global _ONE\n    _ONE = 1\n", 1),
        ("_STAGING: dict = {}\ndef f(g):\n    _STAGING.get(g, {})[1] = 2\n", 1),
        ("TABLE = {'a': 1}\ndef f(k):\n    return TABLE[k]\n", 0),  # read only: a constant
        ("def f():\n    seen = []\n    seen.append(1)\n", 0),  # a local
    ],
)
def test_the_scan_finds_what_it_names(source: str, expected: int) -> None:
    assert len(problems_in(source, "m.py")) == expected


def test_every_mark_on_user_objects_is_named_in_one_module() -> None:
    """faccel/_marks.py defines each ``_faccel_*`` attribute name, and its docstring names every one."""
    import faccel._marks as marks

    spelled: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            text = node.value if isinstance(node, ast.Constant) else None
            if isinstance(text, str) and text.startswith("_faccel_"):
                spelled.setdefault(text, set()).add(path.name)
    assert spelled and all(where == {"_marks.py"} for where in spelled.values()), spelled
    assert all(f"``{name}``" in (marks.__doc__ or "") for name in spelled)
