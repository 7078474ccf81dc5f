"""Crash safety: a checkpoint writer killed with SIGKILL at any moment never leaves a broken latest.

The writers are forked children of a one-thread helper process (run by the
harness) and die by ``SIGKILL``: no ``finally``, no cleanup, exactly a power
cut for the process (the page cache survives it; the fsyncs are what carry a
checkpoint through a real power cut). Every tensor, value and the torch
generator of the checkpoint at step ``s`` say ``s`` (or, for two versions of one
step written with ``replace=True``, their mark), so a restore that mixed two
checkpoints would show it, and so would one of a step the writer had not reached.

The tests run a bounded number of kills; for a long run, run this file as a script::

    python -m tests.test_checkpoint_crash --trials 5000            # new steps, keep=2
    python -m tests.test_checkpoint_crash --trials 5000 --replace  # one step replaced, keep=1
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest

from tests.distributed import checkpoint_workers as cw
from tests.distributed import harness

TRIALS = 60
# Each kill comes within this many writes of the writer's start, a duration the loop measures
# (:func:`tests.distributed.checkpoint_workers.kill_loop`), never a fixed number of seconds.
DELAY_IN_WRITES = 3.0


def deadline(trials: int, one_trial: float) -> float:
    """The helper's deadline for ``trials`` kills: from one trial's measured duration, with room for a
    machine that slows down tenfold and for the helper's start; at least the harness's default."""
    return max(90.0, 60.0 + 10 * trials * (DELAY_IN_WRITES + 1) * one_trial)


def _crash_loop(root: Path, *, trials: int, replace: bool, seed: int) -> list:
    (calibration := root / ".calibration").mkdir()
    timeout = deadline(trials, cw.seconds_of_one_crash_trial(str(calibration)))
    (result,) = harness.run(
        cw.crash_trials,
        world_size=1,
        timeout=timeout,
        root=str(root),
        trials=trials,
        delay_in_writes=DELAY_IN_WRITES,
        seed=seed,
        replace=replace,
    )
    outcomes = result["outcomes"]
    assert len(outcomes) == trials
    for committed, restored in outcomes:
        # the writer's last returned checkpoint, or the one it was killed in the act of finishing
        assert restored in (committed, committed + 1), (committed, restored)
    kills_mid_write = sum(restored == committed for committed, restored in outcomes)
    assert outcomes[-1][1] > trials // 6, "the writers hardly committed anything: the kills came too early"
    assert kills_mid_write > trials // 2
    names = sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
    if replace:  # one step, rewritten in place: never lost, never two
        assert names == [f"step-{cw.REPLACED_STEP:012d}"], names
    else:
        # keep=2, plus at most one more when the last kill came between a commit and its rotation
        assert names[-1] == f"step-{outcomes[-1][1]:012d}" and len(names) <= 3
    return outcomes


@pytest.mark.parametrize("replace", [False, True], ids=["new-steps", "replace-one-step"])
def test_sigkill_at_random_moments_leaves_the_previous_or_the_new_checkpoint(
    tmp_path: Path, replace: bool
) -> None:
    _crash_loop(tmp_path, trials=TRIALS, replace=replace, seed=1234)


@pytest.mark.parametrize("sharded", [False, True])
def test_sigkill_at_every_file_operation_of_a_commit(tmp_path: Path, sharded: bool) -> None:
    (root := tmp_path / "root").mkdir()
    (result,) = harness.run(cw.kill_at_every_operation, world_size=1, root=str(root), sharded=sharded)
    restored = result["restored"]
    assert result["operations"] > 20 and len(restored) == result["operations"]
    # Before the rename: the previous checkpoint (step 2); from the rename on: the new one (3).
    switch = restored.index(3)
    assert restored == [2] * switch + [3] * (len(restored) - switch), restored


def test_sigkill_at_every_file_operation_of_a_replace_with_keep_1(tmp_path: Path) -> None:
    """Replacing the only checkpoint: at every moment the old or the new version is there."""
    (root := tmp_path / "root").mkdir()
    (result,) = harness.run(cw.kill_at_every_operation, world_size=1, root=str(root), replace=True)
    restored = result["restored"]
    assert result["operations"] > 20 and len(restored) == result["operations"]
    switch = restored.index(102)
    assert restored == [2] * switch + [102] * (len(restored) - switch), restored
    assert result["retried"] == [102] * len(restored)  # a retry after any kill completes


def main(argv: list[str] | None = None) -> None:
    """Run the random-moment SIGKILL loop for as many trials as asked."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=1000, help="kills (default 1000; the test runs 60)")
    parser.add_argument("--replace", action="store_true", help="rewrite one step with replace=True, keep=1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        outcomes = _crash_loop(Path(root), trials=args.trials, replace=args.replace, seed=args.seed)
    mid = sum(restored == committed for committed, restored in outcomes)
    print(
        f"{args.trials} SIGKILLs ({mid} mid-write): every restore was whole, the last committed or the next"
    )


if __name__ == "__main__":
    main()
