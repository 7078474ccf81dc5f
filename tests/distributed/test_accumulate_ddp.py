"""Accumulation on two real gloo processes: no all-reduce on non-syncing micro-steps."""

from __future__ import annotations

import torch

from tests.distributed import harness, workers


def _reference(k: int, b: int, world: int) -> list[torch.Tensor]:
    """One process stepping on each group's batches of every rank at once."""
    import faccel

    x, y = workers.seed_task(n=56)
    model = workers.seed_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    shards = [
        faccel.Sharding(num_samples=56, batch_size=b, rank=r, world_size=world).batches(0)
        for r in range(world)
    ]
    n = len(shards[0])
    for first in range(0, n, k):
        optimizer.zero_grad()
        groups = [[i for batch in shard[first : first + k] for i in batch] for shard in shards]
        # each rank: mean over its group's samples (equal batch sizes); DDP: mean over ranks
        loss = sum(torch.nn.functional.mse_loss(model(x[g]), y[g]) for g in groups) / world
        loss.backward()
        optimizer.step()
    return [p.detach().flatten() for p in model.parameters()]


def test_accumulation_syncs_only_at_group_ends_and_matches_one_process() -> None:
    # 56 samples / (2 ranks x 4) = 7 micro-steps a rank: groups of 2, 2, 2 and a partial 1
    results = harness.run(workers.accumulation_loop, world_size=2, accumulation_steps=2, batch_size=4)
    for r in results:
        assert (r["micro_steps"], r["syncs"]) == (7, 4)
        # the small model fits one DDP bucket: exactly one all-reduce per syncing micro-step
        assert r["all_reduces"] == r["syncs"]
    assert results[0]["params"] == results[1]["params"]
    for got, want in zip(results[0]["params"], _reference(k=2, b=4, world=2), strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)
