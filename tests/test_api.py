"""The public surface changes only on purpose."""

from __future__ import annotations

import inspect


def test_public_names_are_pinned() -> None:
    import faccel

    assert sorted(faccel.__all__) == sorted(
        [
            "DistState",
            "LaunchInfo",
            "MicroStep",
            "PreparedLoader",
            "RankLogger",
            "Sharding",
            "accumulate",
            "autocast",
            "backward",
            "broadcast",
            "clip_grad_norm",
            "clip_grad_value",
            "detect",
            "errors",
            "gather",
            "gather_for_metrics",
            "gather_object",
            "get_logger",
            "grad_scaler",
            "is_main_process",
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
            "split_between_processes",
            "state_from_env",
            "to_device",
            "unwrap_model",
            "wait_for_everyone",
            # functional training (torch.func): pytrees, gradient sync, pure optimizers
            "AdamWState",
            "FunctionalState",
            "GradBuckets",
            "SGDState",
            "adamw",
            "grad_buckets",
            "loss_and_grad",
            "model_params",
            "register_pytree",
            "sgd",
            "static_field",
            "sync_grads",
            "tree_map",
            # checkpoints: atomic, pickle-free TrainState checkpoints; weights in the HF layout
            "TrainState",
            "checkpoint",
            "latest_checkpoint",
            "load_model",
            "restore",
            "save_model",
        ]
    )


def test_every_public_function_has_a_runnable_example() -> None:
    import faccel

    for name in faccel.__all__:
        obj = getattr(faccel, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__ and ">>>" in obj.__doc__, f"{name} has no >>> example"


def test_lazy_exports_resolve_and_match_the_typing_imports() -> None:
    import ast
    from pathlib import Path

    import faccel

    tree = ast.parse(Path(faccel.__file__).read_text())
    typed = {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
        for stmt in node.body
        if isinstance(stmt, ast.ImportFrom)
        for alias in stmt.names
    }
    assert typed == set(faccel.__all__)
    for name in faccel.__all__:
        assert getattr(faccel, name) is not None
    assert sorted(dir(faccel)) == sorted(faccel.__all__)


def test_import_is_lazy() -> None:
    import subprocess
    import sys

    code = "import sys, faccel; print(sorted(m for m in sys.modules if m.startswith('faccel')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['faccel']"
