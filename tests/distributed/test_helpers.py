"""Accelerate's helpers on two gloo ranks: find_executable_batch_size, DDP communication hooks (issue 36)."""

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
