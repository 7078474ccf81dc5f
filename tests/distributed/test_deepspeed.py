"""The seed loop under strategy='deepspeed' (ZeRO 1-3) on 2 gloo ranks, against the same loop under DDP.

Skipped without deepspeed (``pip install 'faccel[deepspeed]'``). Marked ``deepspeed``; the
first engine of a fresh machine builds DeepSpeed's small CPU ops with g++
(docs/deepspeed.md gives the measured cost); each run here takes a few seconds.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
        assert not result["offload"]
        assert result["lr"] == ddp[0]["lr"]  # the torch scheduler stepped DeepSpeed's learning rate
        _close(result["params"], ddp[0]["params"])


def test_zero_offload_of_the_optimizer_to_the_cpu_trains_like_ddp(ddp: list[dict]) -> None:
    # ZeRO-Offload's code path (on this CPU-only machine the "offloaded" state was on the CPU anyway).
    # A torch optimizer under offload needs DeepSpeed's own opt-in: it refuses by default.
    config = {
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        "zero_force_ds_cpu_optimizer": False,
    }
    results = harness.run(workers.seed_loop, world_size=2, timeout=300, strategy="deepspeed", config=config)
    for result in results:
        assert result["stage"] == 2 and result["steps"] == 6 and result["offload"]
        _close(result["params"], ddp[0]["params"])


# 88 samples: 11 batches of 4 a rank, so an epoch of accumulation_steps=2 ends with a group of 1;
# 9 steps run through it into the next epoch.
# SGD: AdamW is all but blind to a gradient scaled by a constant (both runs dividing by an extra 2).
_ACCUMULATING = {"accumulation_steps": 2, "samples": 88, "epochs": 2, "steps": 9, "sgd": True}


@pytest.fixture(scope="module")
def ddp_accumulating() -> dict[bool, list[dict]]:
    """The same accumulating loop under DDP: losses as means, and as sums by item count."""
    return {
        items: harness.run(
            workers.seed_loop, world_size=2, timeout=300, strategy="ddp", items=items, **_ACCUMULATING
        )
        for items in (False, True)
    }


@pytest.mark.parametrize(("stage", "items"), [(2, False), (3, False), (2, True)])
def test_accumulation_with_a_partial_last_group_trains_like_ddp(
    ddp_accumulating: dict[bool, list[dict]], stage: int, items: bool
) -> None:
    want = ddp_accumulating[items][0]
    assert want["group_sizes"] == [2, 2, 2, 2, 2, 1, 2, 2, 2]  # the partial group is in the run
    results = harness.run(
        workers.seed_loop,
        world_size=2,
        timeout=300,
        strategy="deepspeed",
        config=workers._zero(stage),
        items=items,
        **_ACCUMULATING,
    )
    for result in results:
        assert result["stage"] == stage and result["group_sizes"] == want["group_sizes"]
        assert result["config"] == {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "train_batch_size": 16,  # 4 x 2 micro-steps x 2 ranks
        }
        assert result["lr"] == want["lr"]
        # The group of 1 is divided by 1, not by DeepSpeed's configured 2 (faccel scales the loss).
        _close(result["params"], want["params"])


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[str, list[dict]]]:
    """ZeRO-2 and ZeRO-3 runs on 2 ranks, checkpointed at step 6, then restored into fresh engines."""
    runs = {}
    for stage in (2, 3):
        root = str(tmp_path_factory.mktemp(f"zero{stage}"))
        runs[stage] = (
            root,
            harness.run(workers.stop_and_resume, world_size=2, timeout=300, stage=stage, root=root),
        )
    return runs


@pytest.mark.parametrize("stage", [2, 3])
def test_a_resume_at_step_6_ends_bitwise_equal_to_the_uninterrupted_run(stopped: dict, stage: int) -> None:
    _, results = stopped[stage]
    for result in results:
        assert result["restored_step"] == 6 and result["ended_step"] == 9
        assert result["after_restore"] == result["saved"]  # ZeRO's masters and moments, bitwise
        assert result["resumed"] == result["uninterrupted"]  # bitwise (floats compared exactly)
        assert result["lr"][0] == result["lr"][1] and result["counters"] == [9, 9]


@pytest.mark.parametrize(("stage", "kind", "built"), [(2, "AdamW", "AdamW"), (3, "Adam", "FusedAdam")])
def test_the_configs_optimizer_and_scheduler_train_checkpoint_and_resume_bitwise(
    tmp_path: Path, stage: int, kind: str, built: str
) -> None:
    """The config's own sections (Accelerate's DummyOptim/DummyScheduler): DeepSpeed builds both;
    the loop steps them as a torch pair; a resume at step 6 of 9 is bitwise, schedule included."""
    results = harness.run(
        workers.stop_and_resume, world_size=2, timeout=300, stage=stage, root=str(tmp_path), from_config=kind
    )
    for result in results:
        assert result["optimizer"] == built  # DeepSpeed's, from the config ("Adam": its FusedAdam, CPU op)
        assert result["restored_step"] == 6 and result["ended_step"] == 9
        assert result["after_restore"] == result["saved"]  # masters and moments, bitwise
        assert result["resumed"] == result["uninterrupted"]  # bitwise
        # WarmupDecayLR from ConfigScheduler(warmup_num_steps=3, total_num_steps=9), lr 0.01: stepped
        # once per optimizer step by the engine; after 9 steps (iteration 8) gamma is (9 - 8) / (9 - 3).
        assert result["schedule"][:3] == ["DeepSpeedScheduler(WarmupDecayLR)", 8, 8]
        assert result["schedule"][3] == [pytest.approx(0.01 / 6)] * 2 and result["lr"][0] == result["lr"][1]
        assert result["counters"] == [9, 9]


@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_checkpoint_holds_only_safetensors_and_json(stopped: dict, stage: int) -> None:
    for result in stopped[stage][1]:
        assert result["files"] == [
            "extras.safetensors",
            "manifest.json",
            "model.safetensors",
            "optimizer.safetensors",
            "rng-00000.json",
            "rng-00001.json",
            "state.json",
        ]


@pytest.mark.parametrize(("written", "read"), [(2, 3), (3, 1)])
def test_a_checkpoint_of_2_ranks_restores_exactly_on_1_rank_at_another_stage(
    stopped: dict, written: int, read: int
) -> None:
    root, results = stopped[written]
    (result,) = harness.run(workers.restore_elsewhere, world_size=1, timeout=300, stage=read, root=root)
    assert result["step"] == 6 and result["view"] == results[0]["saved"]  # resharded, bitwise
    assert result["ended"] == 8 and result["finite"]
    # Another model: refused by name, nothing loaded.
    assert "does not fit the objects given" in result["refusal"] and "[7, 6] in the file" in result["refusal"]
    assert result["untouched"]
    assert "faccel.checkpoint" in result["state_dict"]
    assert "pass sharded=False" in result["sharded"]


@pytest.mark.parametrize("stage", [2, 3])
def test_save_model_writes_the_hf_layout_that_load_model_and_from_pretrained_read(
    tmp_path, stage: int
) -> None:
    results = harness.run(
        workers.save_model_and_the_rest, world_size=2, timeout=300, stage=stage, directory=str(tmp_path)
    )
    for result in results:
        # Shards of at most 40 kB and their index (ZeRO-3: gathered one parameter at a time).
        assert "model.safetensors.index.json" in result["files"] and "config.json" in result["files"]
        assert len([f for f in result["files"] if f.endswith(".safetensors")]) == 4
        assert result["differed"] and result["loaded"]  # load_model into a fresh engine: the trained weights
        assert result["masters"]  # and ZeRO's fp32 masters, which the next step starts from
        assert result["unwrapped"]
        assert result["logged"] in (None, 2)  # rank 0 wrote both steps' reduced losses (trackers compose)
        assert "gradient_clipping" in result["refusal"]  # clip_grad_norm would clip nothing: refused
        assert "even_batches=True" in result["uneven"] and "DeepSpeed" in result["uneven"]
        assert sorted(result["gathered"]) == sorted(results[0]["seen"] + results[1]["seen"])
    main = results[0]
    assert main["from_pretrained"] and main["tied"]  # transformers reads it, the head tied again
    assert main["load_model_plain"] and main["plain_equal"]  # and so does load_model into a plain model


def test_a_bf16_resume_is_bitwise_too_with_zero_s_fp32_masters_saved(tmp_path) -> None:
    results = harness.run(
        workers.stop_and_resume, world_size=2, timeout=300, stage=2, root=str(tmp_path), precision="bf16"
    )
    for result in results:
        # bf16 weights in the model file, ZeRO's fp32 masters beside the moments: both come back.
        assert result["after_restore"] == result["saved"]
        assert result["resumed"] == result["uninterrupted"]


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    reason="DeepSpeed's fp16 on CPU needs oneDNN's fp16 kernels, which this CPU lacks (DeepSpeed: "
    "'Type fp16 is not supported on your device')",
)
def test_an_fp16_resume_is_bitwise_with_the_dynamic_loss_scaler_restored(tmp_path) -> None:
    # DeepSpeed's fp16 runs on a CPU with oneDNN's fp16 kernels (the skip above).
    results = harness.run(
        workers.stop_and_resume, world_size=2, timeout=300, stage=2, root=str(tmp_path), precision="fp16"
    )
    for result in results:
        scaler = result["scaler"]
        saved = scaler["saved"]
        # By step 6 the scaler has skipped overflowing steps and moved its scale from 2**16.
        assert saved["skipped"] > 0 and saved["cur_scale"] != 2.0**16
        assert scaler["fresh"]["cur_scale"] == 2.0**16  # a fresh engine's: restore must set it
        assert scaler["restored"] == saved  # scale, iteration, last overflow, hysteresis, skipped
        assert scaler["ended"][0] == scaler["ended"][1]
        assert result["after_restore"] == result["saved"]
        assert result["resumed"] == result["uninterrupted"]


def test_an_offloaded_run_resumes_bitwise(tmp_path) -> None:
    # ZeRO-2 with the optimizer state offloaded to the CPU (ZeRO-Offload): its checkpoint and
    # restore go through the same gather and scatter, and the resume at step 6 is bitwise.
    ranks = harness.run(
        workers.stop_and_resume, world_size=2, timeout=300, stage=2, root=str(tmp_path), offload=True
    )
    for result in ranks:
        assert result["restored_step"] == 6 and result["ended_step"] == 9
        assert result["after_restore"] == result["saved"]
        assert result["resumed"] == result["uninterrupted"]
