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


# ---- hidden process state: hooks on user objects, the environment, exit handlers, signals ----

# Where faccel may touch process-wide state, and why; every other call is a finding. A hook on a
# user's object must be one of faccel._marks.HOOKS, held by dist.runtime (shutdown removes it).
ALLOWED: dict[tuple[str, str], str] = {
    ("faccel/_loop/_check_in.py", "register_forward_pre_hook"): "faccel._marks.EVAL_CHECK_IN",
    ("faccel/_loop/_prepare.py", "register_step_pre_hook"): "faccel._marks.REBIND_AT_FIRST_STEP",
    (
        "faccel/_loop/_exact/_mode.py",
        "register_post_accumulate_grad_hook",
    ): "faccel._marks.EXACT_BUCKET_READY",
    # launch()'s children set the launcher's variables (of _dist/_launch's table) for themselves
    ("faccel/_dist/_notebook.py", "os.environ.update"): "a launched child's own environment",
    # a group detect() started is stopped at exit; shutdown() unregisters it
    ("faccel/_dist/_process_group.py", "atexit.register"): "the group stopped at exit",
    ("faccel/_dist/_process_group.py", "atexit.unregister"): "the group stopped at exit",
    # stop_signal installs the handlers asked for and puts the previous ones back on exit
    ("faccel/_dist/_signals.py", "signal.signal"): "stop_signal's handlers, restored",
    # a one-process DeepSpeed run: the engine reads LOCAL_RANK from the environment, so it is
    # written where unset (never overwritten), from the launcher table (_dist/_launch.py)
    (
        "faccel/_loop/_strategies/_deepspeed/_engine.py",
        "os.environ.setdefault",
    ): "DeepSpeed's LOCAL_RANK, where unset",
}

# Hooks on a wrapper faccel itself builds (not a user's object): they go with the wrapper.
OWN_WRAPPER_HOOKS: dict[tuple[str, str], str] = {
    (
        "faccel/_loop/_strategies/_ddp/_comm_hooks.py",
        "register_comm_hook",
    ): "prepare(comm_hook=) on faccel's DDP wrapper",
}

_ENVIRON_METHODS = frozenset(
    {"update", "setdefault", "pop", "popitem", "clear", "__setitem__", "__delitem__"}
)
_PROCESS_CALLS = frozenset({"os.putenv", "os.unsetenv", "signal.signal"})


def _dotted(node: ast.expr) -> str:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def process_state_calls(source: str) -> list[str]:
    """Each call or write in ``source`` that changes process-wide state: what it is, as written.

    ``obj.register_*hook(...)``; a write to ``os.environ`` (item assignment or deletion, a
    mutating method) or ``os.putenv`` / ``os.unsetenv``; any ``atexit.*`` call; ``signal.signal``.
    """
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, dotted = node.func.attr, _dotted(node.func)
            if name.startswith("register_") and name.endswith("hook"):
                found.append(name)
            elif (
                (dotted.startswith("os.environ.") and name in _ENVIRON_METHODS)
                or dotted in _PROCESS_CALLS
                or dotted.startswith("atexit.")
            ):
                found.append(dotted)
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.Delete):
            targets = node.targets if isinstance(node, ast.Assign | ast.Delete) else [node.target]
            for target in targets:
                if isinstance(target, ast.Subscript) and _dotted(target.value) == "os.environ":
                    found.append("os.environ[...] written")
    return found


def _findings(kind: str) -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        where = str(path.relative_to(ROOT.parent))
        for call in process_state_calls(path.read_text()):
            if (where, call) not in ALLOWED and (where, call) not in OWN_WRAPPER_HOOKS and kind in call:
                found.append(f"{where}: {call}")
    return found


def test_hooks_on_user_objects_only_where_marks_lists_them() -> None:
    import faccel._marks as marks

    assert _findings("hook") == []
    assert sorted(v for (_, call), v in ALLOWED.items() if call.endswith("hook")) == sorted(
        f"faccel._marks.{name}" for name in ("EVAL_CHECK_IN", "REBIND_AT_FIRST_STEP", "EXACT_BUCKET_READY")
    )
    assert len(marks.HOOKS) == 3


def test_no_environment_writes_outside_the_allow_list() -> None:
    # faccel reads its environment through faccel._dist._launch's table and writes none of it.
    # (DeepSpeed's _engine.py's os.environ.setdefault("DS_ACCELERATOR", ...) is found here until it goes:
    # it changes what every later DeepSpeed import in the process sees.)
    assert _findings("environ") + _findings("putenv") + _findings("unsetenv") == []


def test_no_exit_handlers_or_signal_handlers_outside_the_allow_list() -> None:
    assert _findings("atexit") + _findings("signal") == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("def f(m):\n    m.register_forward_pre_hook(g)\n", ["register_forward_pre_hook"]),
        ("def f(o):\n    o.register_step_post_hook(g)\n", ["register_step_post_hook"]),
        ("import os\nos.environ['X'] = '1'\n", ["os.environ[...] written"]),
        ("import os\ndef f():\n    del os.environ['X']\n", ["os.environ[...] written"]),
        ("import os\nos.environ.setdefault('X', '1')\n", ["os.environ.setdefault"]),
        ("import os\nos.putenv('X', '1')\n", ["os.putenv"]),
        ("import atexit\natexit.register(f)\n", ["atexit.register"]),
        ("import signal\nsignal.signal(2, f)\n", ["signal.signal"]),
        ("import os\nx = os.environ.get('X')\n", []),  # a read: the launcher table's test covers reads
        ("import signal\nsignal.getsignal(2)\n", []),
    ],
)
def test_the_process_state_scan_finds_what_it_names(source: str, expected: list[str]) -> None:
    assert process_state_calls(source) == expected


def test_each_closed_set_is_the_table_its_code_reads() -> None:
    # Issue 31.6: the words of each option are spelled once, as a Literal type (faccel._choices);
    # the tables that act on them have exactly those keys.
    from typing import get_args

    from faccel import _choices
    from faccel._dist._state import PRECISIONS
    from faccel._loop._model import _STRATEGIES
    from faccel._report._tracking import _WRITERS
    from faccel.errors import ArgumentValueError

    assert set(PRECISIONS) == set(get_args(_choices.Precision))
    assert set(_STRATEGIES) | {"deepspeed"} == set(get_args(_choices.Strategy))
    assert set(_WRITERS) | {"all"} == set(get_args(_choices.TrackerKind))
    for name, closed in _choices.CLOSED_SETS.items():
        assert issubclass(closed.error, ArgumentValueError), name


@pytest.mark.parametrize(
    ("call", "error"),
    [
        ("faccel.detect({}, precision='fp32')", "PrecisionError"),
        ("faccel.detect({}, strategy='zero')", "LaunchError"),
        ("faccel.prepare(faccel.detect({}), worker_seeds='ranks')", "ArgumentValueError"),
        ("faccel.prepare(faccel.detect({}), offload='disk')", "ArgumentValueError"),
        ("faccel.prepare(faccel.detect({}), init='zeros')", "ArgumentValueError"),
        ("faccel.init_tracker(faccel.detect({}), '.', kind='jsonlines')", "ArgumentValueError"),
    ],
)
def test_a_word_outside_a_closed_set_is_a_bad_value(call: str, error: str) -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentValueError) as raised:
        eval(call)
    assert type(raised.value).__name__ == error
    assert " must be " in str(raised.value)


def test_every_thread_faccel_starts_is_listed_in_marks() -> None:
    """Each ``Thread(name=...)`` and pool ``thread_name_prefix=`` in faccel is in ``_marks.THREADS``."""
    import faccel._marks as marks

    named: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] in (
                "Thread",
                "ThreadPoolExecutor",
            ):
                for keyword in node.keywords:
                    if keyword.arg in ("name", "thread_name_prefix") and isinstance(
                        keyword.value, ast.Constant
                    ):
                        named.setdefault(keyword.value.value, set()).add(path.name)
    assert named and set(named) <= set(marks.THREADS), named
    assert all(f"``{name}``" in (marks.__doc__ or "") for name in marks.THREADS)
    assert marks.CHECK_IN_GROUP in marks.GROUPS
