"""FSDP2 (fully_shard) on two real gloo processes: the same training as DDP."""

from __future__ import annotations

import pytest
import torch

from tests.distributed import harness, workers


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_fsdp_trains_like_ddp(accumulation_steps: int) -> None:
    ddp = harness.run(
        workers.strategy_loop, world_size=2, strategy="ddp", accumulation_steps=accumulation_steps
    )
    fsdp = harness.run(
        workers.strategy_loop, world_size=2, strategy="fsdp", accumulation_steps=accumulation_steps
    )
    assert fsdp[0]["param_types"] == ["DTensor"] and ddp[0]["param_types"] == ["Parameter"]
    # every rank holds the same full model, and the clipping norms agree across ranks
    assert fsdp[0]["params"] == fsdp[1]["params"]
    assert fsdp[0]["norms"] == pytest.approx(fsdp[1]["norms"], rel=1e-6)
    assert fsdp[0]["norms"] == pytest.approx(ddp[0]["norms"], rel=1e-4)
    for got, want in zip(fsdp[0]["params"], ddp[0]["params"], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)


def test_fsdp_trains_the_same_whatever_the_order_and_split_of_prepare_calls() -> None:
    # Before: with the optimizer first, or in a separate prepare call, FSDP2's new DTensor
    # parameters were never stepped: the model stayed at its initial weights, silently.
    ranks = harness.run(workers.fsdp_prepare_orders, world_size=2)
    for result in ranks:
        reference = result["together"]
        assert reference["params"] != reference["initial"]  # it trained
        for order, got in result.items():
            assert set(got["stepped"]) == {"DTensor"}, order
            assert got["params"] == reference["params"], order  # bitwise, as lists of floats
    assert ranks[0]["together"]["params"] == ranks[1]["together"]["params"]
