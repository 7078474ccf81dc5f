"""The seed loop under strategy='deepspeed' (ZeRO 1-3) on 2 gloo ranks, against the same loop under DDP.

Skipped without deepspeed (``pip install 'faccel[deepspeed]'``). Marked ``deepspeed``; the
first engine of a fresh machine builds DeepSpeed's small CPU ops with g++
(docs/deepspeed.md gives the measured cost); each run here takes a few seconds.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.distributed import deepspeed_workers as workers
from tests.distributed import harness

pytestmark = [
    pytest.mark.deepspeed,
    pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed"),
]


def _close(got: list[list[float]], want: list[list[float]]) -> None:
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def ddp() -> list[dict]:
    return harness.run(workers.seed_loop, world_size=2, timeout=300, strategy="ddp")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_stages_train_like_ddp_with_faccel_filling_the_config(ddp: list[dict], stage: int) -> None:
    results = harness.run(workers.seed_loop, world_size=2, timeout=300, strategy="deepspeed", stage=stage)
    for result in results:
        assert result["kind"] == "DeepSpeedEngine" and result["stage"] == stage and result["steps"] == 6
        assert result["config"] == {
            "train_micro_batch_size_per_gpu": 4,  # the loader's
            "gradient_accumulation_steps": 1,
            "train_batch_size": 8,
        }
        assert result["clipping"] == 0.0  # not DeepSpeed's silent 1.0
        assert result["lr"] == ddp[0]["lr"]  # the torch scheduler stepped DeepSpeed's learning rate
        _close(result["params"], ddp[0]["params"])
