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
            "clip_grad_norm",
            "clip_grad_value",
            "detect",
            "errors",
            "get_logger",
            "grad_scaler",
            "is_main_process",
            "main_process_first",
            "micro_batches",
            "micro_step",
            "optimizer_step",
            "parse_launch",
            "prepare",
            "progress",
            "shutdown",
            "state_from_env",
            "to_device",
            "unwrap_model",
            "wait_for_everyone",
        ]
    )


def test_every_public_function_has_a_runnable_example() -> None:
    import faccel

    for name in faccel.__all__:
        obj = getattr(faccel, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):
            assert obj.__doc__ and ">>>" in obj.__doc__, f"{name} has no >>> example"
