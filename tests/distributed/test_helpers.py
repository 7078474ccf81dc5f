"""Accelerate's helpers on two gloo ranks: find_executable_batch_size, DDP communication hooks."""

from __future__ import annotations

import pytest

from tests.distributed import harness
from tests.distributed import helper_workers as hw


def test_find_executable_batch_size_settles_every_rank_on_one_size() -> None:
    results = harness.run(hw.batch_size_one_rank_oom, world_size=2)
    # 64 -> 57 -> 51 -> 45 -> 40 (int(x * 0.9)); rank 0 never ran out of memory but retried with rank 1
    assert [r["result"] for r in results] == [40, 40]
    assert [r["tried"] for r in results] == [[64, 57, 51, 45, 40]] * 2


@pytest.mark.parametrize("hook", ["fp16", "powersgd"])  # bf16: NCCL only (refused on gloo by name)
def test_comm_hooks_through_prepare_are_active_and_keep_the_ranks_equal(hook: str) -> None:
    plain = harness.run(hw.comm_hook_step, world_size=2, hook=None)
    hooked = harness.run(hw.comm_hook_step, world_size=2, hook=hook)
    assert all(hook.replace("powersgd", "powerSGD") in r["hook"] for r in hooked), [r["hook"] for r in hooked]
    assert hooked[0]["weight"] == hooked[1]["weight"]  # the same compressed average on both ranks
    assert hooked[0]["weight"] != plain[0]["weight"]  # and a compressed one: the hook ran


def test_local_sgd_lets_the_ranks_drift_and_averages_every_n_steps() -> None:
    results = harness.run(hw.local_sgd_run, world_size=2, every=3, steps=7)
    r0, r1 = results
    assert r0["averaged"] == [False, False, True, False, False, True, False]
    for step, synced in enumerate(r0["averaged"]):
        assert (r0["weights"][step] == r1["weights"][step]) == synced  # no gradient all-reduce in between
    assert r0["final"] == r1["final"]  # leaving the block averages once more


def test_profile_writes_one_trace_per_rank_and_cycle(tmp_path) -> None:
    harness.run(hw.profile_run, world_size=2, root=str(tmp_path))
    assert sorted(p.name for p in (tmp_path / "plain").iterdir()) == ["profile_0.json", "profile_1.json"]
    scheduled = sorted(p.name for p in (tmp_path / "scheduled").iterdir())
    assert scheduled == [
        "profile_0_step2.json",
        "profile_0_step4.json",
        "profile_1_step2.json",
        "profile_1_step4.json",
    ]


def test_a_port_asking_for_accelerates_schedule_gets_it_on_two_ranks() -> None:
    # Accelerate's AcceleratedScheduler on 2 processes steps a warmup of 8 twice per optimizer step:
    # the warmup ends after 4 optimizer steps (faccel's own rule: after 8).
    results = harness.run(hw.accelerate_schedule, world_size=2, steps=5)
    assert [r["lrs"] for r in results] == [[0.25, 0.5, 0.75, 1.0, 1.0]] * 2


def test_options_that_must_agree_are_refused_on_every_rank_when_one_rank_differs() -> None:
    results = harness.run(hw.options_that_differ_per_rank, world_size=2)
    for result in results:
        assert result["comm_hook_options"].startswith("SetupMismatchError"), result
        assert (
            "comm_hook_options has matrix_approximation_rank 2, rank 0 has 1" in result["comm_hook_options"]
        )
        assert "enabled True on some ranks and False on others" in result["enabled"], result
        assert "every from 2 to 3" in result["every"], result
        assert result["step"].startswith("UsageError") and "averaged at different steps" in result["step"]
        assert result["untouched"]
        assert result["error_feedback"][0] >= 1 and result["error_feedback"][1] == 0
