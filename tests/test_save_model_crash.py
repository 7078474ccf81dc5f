"""Crash safety of save_model: a writer killed with SIGKILL at any moment leaves the earlier save or its own.

Every weight of a save says its version, so a load that mixed two saves' files
would show it; every save follows a complete one, so a load must never fail.
The writers are forked children of the harness's one-thread helper process,
killed by ``SIGKILL`` (no ``finally``, no cleanup), as in
``tests/test_checkpoint_crash.py`` and with its kill loop
(:func:`tests.distributed.checkpoint_workers.kill_loop`).

The test runs a bounded number of kills; for a long run, run this file as a script::

    python -m tests.test_save_model_crash --trials 250
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pytest

from tests.distributed import harness
from tests.distributed import save_model_workers as sw

TRIALS = 40
# Each kill comes within this many saves of the writer's start, a duration the loop measures
# (:func:`tests.distributed.checkpoint_workers.kill_loop`), never a fixed number of seconds.
DELAY_IN_WRITES = 3.0


def _run_trials(folder: Path, *, trials: int, seed: int) -> dict:
    """The kill loop in the harness's helper, under a deadline scaled from one measured save and load."""
    one_trial = sw.seconds_of_one_crash_trial(str(folder / "calibration"))
    (result,) = harness.run(
        sw.save_model_crash_trials,
        world_size=1,
        timeout=max(90.0, 60.0 + 10 * trials * (DELAY_IN_WRITES + 1) * one_trial),
        directory=str(folder / "model"),
        trials=trials,
        delay_in_writes=DELAY_IN_WRITES,
        seed=seed,
    )
    return result


def _crash_loop(folder: Path, *, trials: int, seed: int) -> list:
    result = _run_trials(folder, trials=trials, seed=seed)
    outcomes = result["outcomes"]
    assert len(outcomes) == trials
    mixed = [pair for pair in outcomes if pair[1] == sw.MIXED]
    unloadable = [pair for pair in outcomes if pair[1] == sw.UNLOADABLE]
    assert not mixed and not unloadable, (len(mixed), len(unloadable))
    for committed, loaded in outcomes:
        # the writer's last finished save, or the one it was killed in the act of finishing
        assert loaded in (committed, committed + 1), (committed, loaded)
    assert outcomes[-1][1] > trials // 4, "the writers hardly saved anything: the kills came too early"
    assert sum(loaded == committed for committed, loaded in outcomes) > trials // 2  # killed mid-save
    # leftovers of a killed save go at the next save's start: at most two saves' files and two temporaries
    assert result["most_files"] <= 2 * (max(sw.SHARD_COUNTS) + 1) + 2, result["most_files"]
    # a save after the kills (a restarted job's) loads and leaves its files alone
    assert result["final"][0] == result["final"][1]
    assert result["files"][0] == result["files"][1]
    return outcomes


def test_sigkill_at_random_moments_loads_the_earlier_save_or_the_new_one_never_a_mix(
    tmp_path: Path,
) -> None:
    _crash_loop(tmp_path, trials=TRIALS, seed=1234)


def _assert_old_then_new_and_retries_clean(result: dict, before: int, after: int) -> None:
    loaded = result["loaded"]
    assert result["operations"] > 8 and len(loaded) == result["operations"]
    # Before the commit: the earlier save; from the commit on: the new one; never a mix, never nothing.
    switch = loaded.index(after)
    assert switch > 0 and loaded == [before] * switch + [after] * (len(loaded) - switch), loaded
    # A retry after any kill completes, and leaves exactly its own files (no temporaries, no orphans).
    assert result["retried"] == [after] * len(loaded)
    assert result["files"] == [sw.expected_files(after)] * len(loaded)


@pytest.mark.parametrize(
    ("before", "after"),
    [(4, 5), (5, 6), (6, 7), (7, 8)],
    ids=["4-shards-over-4", "1-file-over-4", "2-shards-over-1-file", "4-shards-over-2"],
)
def test_sigkill_at_every_file_operation_of_a_save(tmp_path: Path, before: int, after: int) -> None:
    (result,) = harness.run(
        sw.save_model_kill_at_every_operation,
        world_size=1,
        directory=str(tmp_path / "model"),
        before=before,
        after=after,
    )
    _assert_old_then_new_and_retries_clean(result, before, after)


@pytest.mark.parametrize(
    ("before", "after"), [(5, 6), (6, 7)], ids=["1-file-over-4-shards", "2-shards-over-1-file"]
)
def test_sigkill_at_every_file_operation_of_a_sharded_model_s_save(
    tmp_path: Path, before: int, after: int
) -> None:
    """The same, through a sharded model's save (FSDP2 on a world of one): its plan's shards, written
    by the writer thread, and rank 0's commit. A save on more ranks runs the same code and commit;
    a write failing on one of 2 ranks: tests/distributed/test_save_model_sharded.py."""
    (result,) = harness.run(
        sw.sharded_save_kill_at_every_operation,
        world_size=1,
        timeout=180,
        directory=str(tmp_path / "model"),
        before=before,
        after=after,
    )
    _assert_old_then_new_and_retries_clean(result, before, after)


def main(argv: list[str] | None = None) -> None:
    """Run the random-moment SIGKILL loop for as many trials as asked; print the counts."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trials", type=int, default=250, help=f"kills (default 250; the test runs {TRIALS})"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        result = _run_trials(Path(folder), trials=args.trials, seed=args.seed)
    outcomes = result["outcomes"]
    mixed = sum(loaded == sw.MIXED for _, loaded in outcomes)
    unloadable = sum(loaded == sw.UNLOADABLE for _, loaded in outcomes)
    other = sum(loaded >= 0 and loaded not in (c, c + 1) for c, loaded in outcomes)
    mid = sum(loaded == committed for committed, loaded in outcomes)
    print(
        f"{len(outcomes)} SIGKILLs during save_model ({mid} mid-save): {mixed} mixed, "
        f"{unloadable} unloadable, {other} of another version; most files at once: {result['most_files']}; "
        f"the save after them: {'whole' if result['final'][0] == result['final'][1] else 'BROKEN'}, "
        f"files {'as expected' if result['files'][0] == result['files'][1] else result['files']}"
    )
    if mixed or unloadable or other:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
