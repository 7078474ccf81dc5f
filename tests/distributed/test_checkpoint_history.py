"""Named checkpoints, an older one into a new root, a rollback: on two gloo ranks."""

from __future__ import annotations

from pathlib import Path

from tests.distributed import harness
from tests.distributed import history_workers as hw


def test_two_ranks_restore_named_and_older_checkpoints_and_roll_back(tmp_path: Path) -> None:
    results = harness.run(hw.history, world_size=2, root=str(tmp_path))
    for result in results:
        assert "also holds later checkpoints" in result["refused"], result["refused"]
        assert "the ranks passed different rollback= values (from 'move' to 'delete')" in result["mixed"][0]
        assert result["mixed"][1], result["mixed"]
        assert result["named"] == [1, True] and result["rolled"] == [2, True]
        assert [name for name in result["run"] if not name.startswith(".")] == [
            "abandoned-after-step-000000000002",
            "epoch_0",
            "step-000000000001",
            "step-000000000002",
            "step-000000000003",
        ]
        assert result["aside"] == ["step-000000000003"]
        assert result["new"] == ["step-000000000002"]
