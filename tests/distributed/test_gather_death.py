"""A peer dying during a checkpoint's whole-state gather is the survivor's named ``CheckpointError``.

the gather (FSDP2 ``sharded=False``, DeepSpeed's ZeRO partitions) ran before
any agreement step, and the survivor got gloo's raw ``RuntimeError: Connection reset by peer``.
The long proof (hundreds of one-rank kills of DeepSpeed checkpoints) is
``scripts/prove_gather_kills.py``; its bounded version is tests/test_gather_kills.py.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.distributed import gather_workers, harness


def _assert_named(survivor: dict) -> None:
    assert survivor["error"] == "CheckpointError", survivor
    assert survivor["message"].startswith("gathering the state of the checkpoint of step 1: rank 0"), survivor
    assert "or lost one of them" in survivor["message"]


def test_fsdp2_whole_tensor_checkpoint_a_peer_dying_in_the_gather_is_named(tmp_path: Path) -> None:
    survivor, _ = harness.run(
        gather_workers.peer_dies_in_the_gather,
        timeout=120,
        lost=(1,),
        root=str(tmp_path),
        strategy="fsdp",
        timeout_s=20.0,
    )
    _assert_named(survivor)
    assert not list(tmp_path.glob("step-*"))


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_zero2_checkpoint_a_peer_dying_in_the_gather_is_named(tmp_path: Path) -> None:
    survivor, _ = harness.run(
        gather_workers.peer_dies_in_the_gather,
        timeout=180,
        lost=(1,),
        root=str(tmp_path),
        strategy="deepspeed",
        timeout_s=20.0,
        stage=2,
    )
    _assert_named(survivor)
    assert not list(tmp_path.glob("step-*"))


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("where", ["backward", "step"])
def test_deepspeed_a_peer_dying_in_a_training_step_is_named(where: str, tmp_path: Path) -> None:
    harness.run(
        gather_workers.peer_dies_in_a_deepspeed_step,
        timeout=180,
        lost=(0, 1),
        where=where,
        timeout_s=20.0,
        out=str(tmp_path),
    )
    survivor = json.loads((tmp_path / "outcome.json").read_text())
    assert survivor["error"] == "RankFailedError", survivor
    what = "the DeepSpeed backward" if where == "backward" else "the DeepSpeed optimizer step"
    assert survivor["message"].startswith(f"{what} on rank 0 of 2: rank 1, its only peer, left"), survivor
