"""Crash safety: a checkpoint writer killed with SIGKILL at any moment never leaves a broken latest.

The writers are forked children of a one-thread helper process (run by the
harness) and die by ``SIGKILL``: no ``finally``, no cleanup, exactly a power
cut for the process (the page cache survives it; the fsyncs are what carry a
checkpoint through a real power cut). Every tensor, value and the torch
generator of the checkpoint at step ``s`` say ``s``, so a restore that mixed
two checkpoints would show it, and so would one of a step the writer had not
reached.
"""

from __future__ import annotations

from pathlib import Path

from tests.distributed import checkpoint_workers as cw
from tests.distributed import harness

TRIALS = 60


def test_sigkill_at_random_moments_leaves_the_previous_or_the_new_checkpoint(tmp_path: Path) -> None:
    (result,) = harness.run(
        cw.crash_trials, world_size=1, root=str(tmp_path), trials=TRIALS, max_delay=0.1, seed=1234
    )
    outcomes = result["outcomes"]
    assert len(outcomes) == TRIALS
    for committed, restored in outcomes:
        # the writer's last returned checkpoint, or the one it was killed in the act of finishing
        assert restored in (committed, committed + 1), (committed, restored)
    kills_mid_write = sum(restored == committed for committed, restored in outcomes)
    assert outcomes[-1][1] > 10, "the writers hardly committed anything: the kills came too early"
    assert kills_mid_write > TRIALS // 2
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    # keep=2, plus at most one more when the last kill came between a commit and its rotation
    assert names[-1] == f"step-{outcomes[-1][1]:012d}" and len(names) <= 3


def test_sigkill_at_every_file_operation_of_a_commit(tmp_path: Path) -> None:
    (root := tmp_path / "root").mkdir()
    (result,) = harness.run(cw.kill_at_every_operation, world_size=1, root=str(root))
    restored = result["restored"]
    assert result["operations"] > 20 and len(restored) == result["operations"]
    # Before the rename: the previous checkpoint (step 2); from the rename on: the new one (3).
    switch = restored.index(3)
    assert restored == [2] * switch + [3] * (len(restored) - switch), restored
