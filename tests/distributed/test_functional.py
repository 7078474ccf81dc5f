"""Functional training on two real gloo processes (see harness.py for the cost model)."""

from __future__ import annotations

import torch

from tests.distributed import functional_workers, harness

CONFIGS = [
    ("sgd", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3}),
    ("adamw", {"lr": 1e-2, "weight_decay": 1e-2, "amsgrad": True}),
]


def test_functional_path_reaches_the_ddp_paths_parameters() -> None:
    results = harness.run(functional_workers.functional_vs_ddp, world_size=2, configs=CONFIGS, steps=6)
    for rank in results:
        for (name, _), run in zip(CONFIGS, rank["results"], strict=True):
            for got, want in zip(run["functional"], run["ddp"], strict=True):
                torch.testing.assert_close(
                    torch.tensor(got),
                    torch.tensor(want),
                    rtol=1e-6,
                    atol=1e-7,
                    msg=lambda m, n=name: f"{n}: {m}",
                )
    # Both ranks hold the same parameters: the gradients really were averaged.
    for a, b in zip(results[0]["results"], results[1]["results"], strict=True):
        assert a["functional"] == b["functional"]


def test_the_guards_refuse_unsynced_functional_code_under_a_process_group() -> None:
    results = harness.run(functional_workers.functional_vs_ddp, world_size=2, configs=[], steps=0)
    for rank in results:
        assert "will_sync_grads=True" in rank["guards"]["model_params"]
        assert "unwrap_model" in rank["guards"]["loss_and_grad"]
        # The hazard itself: torch.func through the DDP module gave each rank its own gradient.
        assert rank["ddp_func_grads_equal_across_ranks"] is False


def test_sync_grads_equals_a_per_tensor_all_reduce_average() -> None:
    results = harness.run(functional_workers.sync_grads_vs_per_tensor, world_size=2)
    for rank in results:
        for label in ("one_bucket", "capped"):
            assert rank[label] == {"same_structure": True, "static_kept": True, "equal": True, "dtypes": True}
        assert rank["input_untouched"] and rank["dict_equal"]


def test_the_functional_seed_example_trains_like_the_ddp_seed_example() -> None:
    functional = harness.run(functional_workers.run_example, world_size=2, name="functional_seed")
    ddp = harness.run(functional_workers.run_example, world_size=2, name="seed_loop")
    # Each rank's last loss, on its own last batch: the same in both programs.
    torch.testing.assert_close(torch.tensor(functional), torch.tensor(ddp), rtol=1e-5, atol=1e-6)
