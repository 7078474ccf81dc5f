"""Functional training on two real gloo processes (see harness.py for the cost model)."""

from __future__ import annotations

import pytest
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


def test_sync_grads_equals_a_per_tensor_all_reduce_average_with_fresh_or_reused_buckets() -> None:
    results = harness.run(functional_workers.sync_grads_vs_per_tensor, world_size=2)
    for rank in results:
        for label in ("one_bucket", "capped"):
            assert rank[label] == {"same_structure": True, "static_kept": True, "equal": True, "dtypes": True}
        for label in ("reused_one_bucket", "reused_capped"):
            assert rank[label] == {
                "equal": True,
                "reused": True,
                "in_buffers": True,
                "round_trip": True,
                "static_kept": True,
            }
        assert rank["swapped_back"]
        assert (
            "leaf ['w'] is a (4, 5) torch.float32 tensor on cpu, expected (5, 4)" in rank["misfit"]["shape"]
        )
        assert (
            "leaf ['a'] is a tensor where the buckets' tree had none" in rank["misfit"]["tensor_where_none"]
        )
        assert "made for world_size=1, this is a world of 2" in rank["misfit"]["other_world"]
        assert "its keys differ: missing ['b'], unexpected ['bias']" in rank["misfit"]["keys"]
        assert rank["no_tensors"] == {"a": None}
        assert rank["input_untouched"] and rank["dict_equal"]


def test_the_functional_seed_example_on_two_processes_trains_like_ddp_would() -> None:
    import faccel

    epochs = 2
    results = harness.run(functional_workers.functional_seed_example, world_size=2, epochs=epochs)
    assert results[0]["params"] == results[1]["params"] and results[0]["step"] == 8 * epochs

    # What DDP over two ranks computes, in one process: each step averages the ranks' mean losses.
    example = functional_workers.load_example("functional_seed")
    x, y = example.make_task()
    model = example.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.99**step)
    shards = [
        faccel.Sharding(num_samples=len(x), batch_size=32, rank=r, world_size=2, shuffle=True, seed=0)
        for r in range(2)
    ]
    losses: list[torch.Tensor] = []
    for epoch in range(epochs):
        per_rank = [shard.batches(epoch) for shard in shards]
        for step in range(shards[0].num_batches):
            optimizer.zero_grad()
            losses = [torch.nn.functional.mse_loss(model(x[b[step]]), y[b[step]]) for b in per_rank]
            (sum(losses) / 2).backward()
            optimizer.step()
            scheduler.step()
    for got, want in zip(results[0]["params"], model.parameters(), strict=True):
        torch.testing.assert_close(torch.tensor(got), want.detach().flatten(), rtol=1e-5, atol=1e-6)
    for rank, result in enumerate(results):  # each rank's last loss, on its own last batch
        assert result["loss"] == pytest.approx(losses[rank].item(), rel=1e-5)
