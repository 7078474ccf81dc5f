"""``backward(..., items=n)`` on two gloo ranks equals the one-process gradient of the global token mean."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import harness, items_workers


def _reference(
    samples: int, batch_size: int, k: int, world: int
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """One process: per group, every rank's micro-batches at once, loss = token sum / token count."""
    import faccel

    model = items_workers.token_model()
    shards = [
        faccel.Sharding(num_samples=samples, batch_size=batch_size, rank=r, world_size=world).batches(0)
        for r in range(world)
    ]
    grads, counts = [], []
    for first in range(0, len(shards[0]), k):
        model.zero_grad()
        batches = [items_workers.padded(list(b)) for shard in shards for b in shard[first : first + k]]
        total = sum(int((labels != -100).sum()) for _, labels in batches)
        loss = sum(items_workers.loss_sum(model, t, lab) for t, lab in batches) / total
        loss.backward()
        grads.append([p.grad.detach().flatten().clone() for p in model.parameters()])
        counts.append(total)
    return grads, counts


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gradients_equal_the_global_token_mean_with_accumulation_and_a_partial_group(strategy: str) -> None:
    # 12 samples / 2 ranks / batches of 2: 3 micro-batches a rank, groups of 2 and a partial 1
    results = harness.run(
        items_workers.items_loop,
        world_size=2,
        strategy=strategy,
        samples=12,
        batch_size=2,
        accumulation_steps=2,
    )
    want_grads, want_counts = _reference(samples=12, batch_size=2, k=2, world=2)
    for r in results:
        assert r["counts"] == want_counts
        assert len(r["grads"]) == len(want_grads) == 2
        for got_group, want_group in zip(r["grads"], want_grads, strict=True):
            for got, want in zip(got_group, want_group, strict=True):
                torch.testing.assert_close(torch.tensor(got), want, rtol=0, atol=1e-6)
