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
