"""The public surface changes only on purpose.

``faccel/_public.py``'s ``PUBLIC`` is the one table of public names: each
namespace's ``__all__``, lazy imports and ``dir()`` are derived from it, and
every test here walks it. ``PINNED`` below is the one deliberate copy: a
change to the table fails ``test_public_names_are_pinned`` until it is
repeated here, so a new or removed public name shows up in review as a test
edit, not as a side effect.
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

PINNED: dict[str, list[str]] = {
    "faccel": [
        "ConfigOptimizer",
        "ConfigScheduler",
        "DistState",
        "LaunchInfo",
        "MicroStep",
        "PreparedLoader",
        "RankLogger",
        "Sharding",
        "accumulate",
        "any_rank",
        "autocast",
        "backward",
        "broadcast",
        "clip_grad_norm",
        "clip_grad_value",
        "detect",
        "errors",
        "free_memory",
        "func",
        "gather",
        "gather_for_metrics",
        "gather_object",
        "get_logger",
        "launch",
        "print",
        "grad_scaler",
        "main_process_first",
        "micro_batches",
        "micro_step",
        "optimizer_step",
        "pad_across_processes",
        "parse_launch",
        "prepare",
        "progress",
        "reduce",
        "set_seed",
        "shutdown",
        "steps_per_epoch",
        "split_between_processes",
        "state_from_env",
        "to_device",
        "uneven_inputs",
        "unwrap_model",
        "wait_for_everyone",
        # checkpoints: atomic, pickle-free TrainState checkpoints; weights in the HF layout
        "TrainState",
        "Tracker",
        "end_training",
        "init_tracker",
        "log",
        "checkpoint",
        "latest_checkpoint",
        "load_model",
        "restore",
        "save_model",
        # N-D parallelism: the layout of the ranks and the DeviceMesh built from it
        "Layout",
        "device_mesh",
        # mixture of experts: the experts' load, the auxiliary loss, the loss-free bias
        "expert_load",
        "load_balancing_loss",
        "update_expert_bias",
        # context parallelism: each context rank's head-tail slice of every sequence, and back
        "context_attention",
        "context_positions",
        "context_shard",
        "context_unshard",
        # pipeline stages: a model cut into stages, its schedule, one training step for every layout
        "PipelinedModel",
        "Schedule",
        "forward_backward",
        # fault tolerance: replicas that come and go between steps, healed from a live peer (torchft)
        "FaultTolerance",
        "ReplicaQuorum",
        "fault_tolerant",
        "replica_commit",
        "replica_quorum",
        # preemption: a stop signal as a flag, read with any_rank at a step boundary
        "StopSignal",
        "stop_signal",
        # large models: the memory plan before launch (python -m faccel plan)
        "MemoryPlan",
        "estimate_memory",
        # porting from Accelerate (docs/from-accelerate.md)
        "accelerate_scheduler_steps",
        "find_executable_batch_size",
        "LocalSGD",
        "local_sgd",
        "profile",
        "local_main_process_first",
        # observing a run: the meter a step, MFU's FLOPs, stragglers every N steps (docs/observe.md)
        "Meter",
        "start_meter",
        "measure",
        "count_flops",
        "transformer_flops",
        "Spread",
        "Straggler",
        "check_stragglers",
    ],
    # functional training (torch.func): pytrees, gradient sync, pure optimizers
    "faccel.func": [
        "AdamWState",
        "FunctionalState",
        "GradBuckets",
        "Optimizer",
        "ParamGroupsState",
        "SGDState",
        "adamw",
        "grad_buckets",
        "loss_and_grad",
        "model_params",
        "param_groups",
        "register_pytree",
        "sgd",
        "static_field",
        "sync_grads",
        "tree_map",
    ],
}


def _table() -> dict[str, dict[str, tuple[str, ...]]]:
    import faccel

    return {space: dict(modules) for space, modules in faccel._public.PUBLIC.items()}


def test_public_names_are_pinned() -> None:
    table = _table()
    assert sorted(table) == sorted(PINNED)
    for namespace, names in PINNED.items():
        listed = [name for module_names in table[namespace].values() for name in module_names]
        assert len(listed) == len(set(listed)), f"{namespace}: a name listed twice"
        assert sorted(listed) == sorted(names), namespace
        assert importlib.import_module(namespace).__all__ == sorted(names)


def test_no_name_is_public_in_two_namespaces() -> None:
    namespaces = list(PINNED.values())
    assert not set(namespaces[0]) & set(namespaces[1])


@pytest.mark.parametrize("namespace", sorted(PINNED))
def test_every_public_function_has_a_runnable_example(namespace: str) -> None:
    module = importlib.import_module(namespace)
    for name in module.__all__:
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__ and ">>>" in obj.__doc__, f"{namespace}.{name} has no >>> example"


@pytest.mark.parametrize("namespace", sorted(PINNED))
def test_lazy_exports_resolve_and_match_the_typing_imports(namespace: str) -> None:
    """The TYPE_CHECKING block (for type checkers) says what the table says, name for name."""
    module = importlib.import_module(namespace)
    tree = ast.parse(Path(module.__file__).read_text())
    typed = {
        (stmt.module, alias.name, alias.asname)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for stmt in node.body
        if isinstance(stmt, ast.ImportFrom)
        for alias in stmt.names
    }
    # `from m import x as x`: each name re-exported explicitly, from the module the table names.
    exports = _table()[namespace]
    table = {(module_name, name, name) for module_name, names in exports.items() for name in names}
    assert typed == table
    for name in module.__all__:
        value = getattr(module, name)
        assert value is not None
        source = next(m for m, names in _table()[namespace].items() if name in names)
        if source == namespace:
            assert inspect.ismodule(value) and value.__name__ == f"{namespace}.{name}"
        else:
            assert value is getattr(importlib.import_module(source), name)
    assert sorted(dir(module)) == sorted(module.__all__)
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        _ = module.nonexistent


def test_the_functional_names_are_no_longer_flat() -> None:
    import faccel

    for name in [*PINNED["faccel.func"], "is_main_process"]:
        assert not hasattr(faccel, name), name


def test_import_is_lazy() -> None:
    import subprocess
    import sys

    code = "import sys, faccel; print(sorted(m for m in sys.modules if m.startswith('faccel')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['faccel', 'faccel._public']"  # the name table: importlib only
    code = "import sys, faccel.func; print(sorted(m for m in sys.modules if m.startswith('faccel')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['faccel', 'faccel._public', 'faccel.func']"


def _raises_sections(doc: str) -> list[str]:
    """The exception names a Google-style docstring's ``Raises:`` section lists."""
    names: list[str] = []
    lines = doc.expandtabs().splitlines()
    for index, line in enumerate(lines):
        if line.strip() != "Raises:":
            continue
        indent = len(line) - len(line.lstrip())
        for entry in lines[index + 1 :]:
            if entry.strip() and len(entry) - len(entry.lstrip()) <= indent:
                break  # the next section
            head = entry.strip().split(":", 1)[0]
            if head.isidentifier() and entry.strip().startswith(head + ":"):
                names.append(head)
    return names


@pytest.mark.parametrize("namespace", sorted(PINNED))
def test_every_raises_section_names_real_exception_classes(namespace: str) -> None:
    import builtins

    import faccel.errors

    module = importlib.import_module(namespace)
    seen = 0
    for name in module.__all__:
        obj = getattr(module, name)
        members = (
            [obj] if inspect.isfunction(obj) else [m for _, m in inspect.getmembers(obj, inspect.isfunction)]
        )
        for member in members if (inspect.isfunction(obj) or inspect.isclass(obj)) else []:
            for raised in _raises_sections(inspect.getdoc(member) or ""):
                seen += 1
                found = getattr(faccel.errors, raised, None) or getattr(builtins, raised, None)
                assert isinstance(found, type) and issubclass(found, BaseException), (
                    f"{namespace}.{name}: Raises names {raised!r}, which is no exception class"
                )
    assert seen > 0
