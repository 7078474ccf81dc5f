"""Checkpoints under real two-process DDP over gloo (see harness.py for the cost model)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from tests.distributed import checkpoint_workers as cw
from tests.distributed import harness
from tests.strategies import checkpoint_specs


def _assert_resumes_exactly(results: list[dict]) -> None:
    assert [r["rank"] for r in results] == list(range(len(results)))
    # (The ranks' digests differ: batch norm's running statistics are each rank's own.)
    for result in results:
        for stop, case in result["resumed"].items():
            assert case["restored"] == case["expected"], (result["rank"], stop)
            assert case["digest"] == result["reference"], f"rank {result['rank']} resumed at {stop} diverged"


def test_two_ranks_resume_mid_epoch_bitwise() -> None:
    spec = cw.example_spec(samples=30)  # 15 a rank, batch 4: 3 full batches (batch norm drops the last)
    with tempfile.TemporaryDirectory() as root:
        results = harness.run(cw.resume_cases, world_size=2, spec=spec, stops=[0, 2, 3, 5, 9], root=root)
    _assert_resumes_exactly(results)
    assert results[0]["resumed"]["5"]["restored"] == [5, 1, 2]  # mid-epoch of epoch 1


@pytest.mark.parametrize("world_size", [3, 4])
def test_three_and_four_ranks_resume_bitwise(world_size: int) -> None:
    # Over more than two ranks an all-reduce's sum of an element depends on where the element lies in
    # its bucket; a fresh DDP's first step used to reduce in another layout than a running one's.
    spec = cw.example_spec(samples=48)  # 3 ranks: 2 batches an epoch; 4 ranks: 3 (batch 4, drop_last)
    with tempfile.TemporaryDirectory() as root:
        results = harness.run(cw.resume_cases, world_size=world_size, spec=spec, stops=[3, 5], root=root)
    _assert_resumes_exactly(results)
    assert results[0]["resumed"]["5"]["restored"][1] == 1  # stop 5 is in epoch 1 at both sizes


@given(spec=checkpoint_specs(), data=st.data())
@settings(max_examples=6)
def test_two_ranks_resume_bitwise_for_generated_runs(spec: dict, data: st.DataObject) -> None:
    stops = data.draw(
        st.lists(st.integers(min_value=0, max_value=spec["total_steps"]), min_size=1, max_size=3)
    )
    with tempfile.TemporaryDirectory() as root:
        results = harness.run(cw.resume_cases, world_size=2, spec=spec, stops=sorted(set(stops)), root=root)
    _assert_resumes_exactly(results)


def test_every_rank_writes_and_restores_its_own_generators(tmp_path: Path) -> None:
    results = harness.run(cw.checkpoint_layout, world_size=2, root=str(tmp_path))
    files = [
        "extras.safetensors",
        "manifest.json",
        "model.safetensors",
        "optimizer.safetensors",
        "rng-00000.json",
        "rng-00001.json",
        "state.json",
    ]
    assert [r["files"] for r in results] == [files, files]  # complete on both ranks on return
    assert results[0]["rng"] != results[1]["rng"]  # the ranks' generators differ...
    assert [r["restored_rng"] for r in results] == [r["rng"] for r in results]  # ...and each gets its own


def test_save_model_returns_on_every_rank_once_the_files_are_complete(tmp_path: Path) -> None:
    results = harness.run(cw.save_model_then_read, world_size=2, directory=str(tmp_path), max_shard_size=300)
    assert (
        results[0]["files"] == results[1]["files"] and "model.safetensors.index.json" in results[0]["files"]
    )
    assert all(r["equal"] for r in results)


def test_ranks_disagreeing_on_the_step_all_raise_and_commit_nothing(tmp_path: Path) -> None:
    results = harness.run(cw.mismatched_steps, world_size=2, root=str(tmp_path))
    assert all(r["error"] and "different steps" in r["error"] for r in results)
    assert all(not r["listed"] for r in results)


def test_a_rank_that_fails_validation_stops_every_rank_before_loading(tmp_path: Path) -> None:
    results = harness.run(cw.one_rank_fails, world_size=2, root=str(tmp_path))
    assert "does not fit" in results[1]["error"] and "model.safetensors" in results[1]["error"]
    assert "failed on 1 other rank" in results[0]["error"]
    assert all(r["unchanged"] for r in results)


def test_a_two_rank_checkpoint_at_an_epoch_boundary_restores_into_one_process(tmp_path: Path) -> None:
    # Was test_a_two_rank_checkpoint_restores_into_one_process, from a checkpoint at batch 1
    # of epoch 1: that position counts batches of 2 ranks and is now refused in 1 process
    # (test_a_mid_epoch_checkpoint_of_two_ranks_is_refused_in_one_process). An epoch boundary
    # carries over exactly: the same restore, from a checkpoint at batch 0.
    import faccel

    harness.run(cw.checkpoint_layout, world_size=2, root=str(tmp_path), until=2, epoch_end=True)
    spec = cw.example_spec()
    dist = faccel.detect({})
    target, _ = cw.fresh(dist, spec, seed=1)
    before = [p.detach().clone() for p in target.model.parameters()]
    restored = faccel.restore(dist, target, tmp_path)
    assert (restored.step, restored.epoch, restored.position) == (2, 1, 0)
    # the saved weights (rank 0's, equal on both ranks under DDP), not the fresh ones
    assert not all(torch.equal(a, b) for a, b in zip(before, target.model.parameters(), strict=True))
    saved = load_file(faccel.latest_checkpoint(tmp_path) / "model.safetensors")
    live = faccel.unwrap_model(target.model).state_dict()
    assert saved and all(torch.equal(saved[name], live[name]) for name in saved)


def test_a_mid_epoch_checkpoint_of_two_ranks_is_refused_in_one_process(tmp_path: Path) -> None:
    """It used to restore, replay samples and crash later in the scheduler."""
    import faccel

    harness.run(cw.checkpoint_layout, world_size=2, root=str(tmp_path))  # step 3: batch 1 of epoch 1
    dist = faccel.detect({})
    target, _ = cw.fresh(dist, cw.example_spec(), seed=1)
    before = cw.digest(target)
    with pytest.raises(faccel.errors.CheckpointError) as caught:
        faccel.restore(dist, target, tmp_path)
    message = str(caught.value)
    assert "written by 2 processes" in message and "restored by 1" in message
    assert "batch 1 of epoch 1" in message and "epoch boundary" in message
    assert cw.digest(target) == before


def test_a_mid_epoch_checkpoint_without_its_loader_is_refused_at_another_world_size_on_every_rank(
    tmp_path: Path,
) -> None:
    # Was test_ddp_restore_at_another_world_size_is_refused_on_every_rank: DDP restores at any
    # world size (tests/distributed/test_resize.py), except a position inside an
    # epoch that the checkpoint cannot place in the epoch's global order (no TrainState.loader).
    harness.run(cw.checkpoint_layout, world_size=2, root=str(tmp_path))
    results = harness.run(cw.restore_at_another_world_size, world_size=3, root=str(tmp_path))
    for r in results:
        assert r["error"] and "written by 2 processes at batch 1 of epoch 1, restored by 3" in r["error"]
        assert "does not record the global position" in r["error"] and "loader=loader" in r["error"]
        assert r["unchanged"]


def test_extras_that_differ_between_ranks_are_refused_and_rank_extras_come_back_per_rank(
    tmp_path: Path,
) -> None:
    """Rank 1 saved [1, 1, 1] and got rank 0's [0, 0, 0] back: now refused; rank_extras keep each."""
    results = harness.run(cw.rank_extras, world_size=2, root=str(tmp_path / "ckpt"))
    for rank, r in enumerate(results):
        assert "extras ['seen'] differ between ranks" in r["refused"], r["refused"]
        assert "rank_extras" in r["refused"]
        assert r["listed_after_refusal"] == []  # refused before any folder was made
        assert r["batch"] == [rank] * 3 and r["seen"] == rank * 10
        assert r["shared"] == [7, 7]


def test_checkpoint_on_the_main_process_only_is_an_error_within_the_arrival_timeout(tmp_path: Path) -> None:
    results = harness.run(cw.called_on_rank0_only, world_size=2, root=str(tmp_path), arrival=2.0)
    zero, one = results
    assert zero["error"].startswith("CheckpointError") and "every rank must call" in zero["error"]
    assert "rank(s) [1]" in zero["error"] and "arrival_timeout" in zero["error"]
    assert "; rank 1 was last in prepare() (its collective #" in zero["error"], zero["error"]
    assert zero["seconds"] >= 2.0  # the arrival timeout ended it (the message says so), not sooner
    # Rank 1's next collective does not wait out the process group's timeout (60 s in the worker):
    # rank 0's process ended. Compared with that timeout, the alternative cause, not with a clock.
    assert one["error"] and one["seconds"] < 60, one
    assert not list(tmp_path.iterdir())


def test_each_checkpoint_collective_alone_is_an_error_and_a_late_rank_is_told(tmp_path: Path) -> None:
    zero, one = harness.run(cw.each_collective_alone, world_size=2, root=str(tmp_path), arrival=1.0)
    for name in ("checkpoint", "restore", "save_model"):
        message, seconds = zero["seen"][name]
        assert f"{name}() was called on rank(s) [0] only" in message and "every rank must call" in message
        assert seconds >= 1.0, (name, seconds)  # waited its arrival timeout; the message names it
    message, _ = one["seen"]["late"]
    assert "gave up waiting" in message, one["seen"]  # told by rank 0's mark, not by a timeout
    assert zero["listed"] == one["listed"] == []


def test_a_checkpoint_slower_than_the_collective_timeout_is_a_named_error(tmp_path: Path) -> None:
    results = harness.run(cw.slow_checkpoint, world_size=2, root=str(tmp_path), group_timeout=1.0, delay=2.5)
    waiting = results[1]["error"]
    assert waiting.startswith("CheckpointError"), waiting
    assert "step 3" in waiting and "faccel.detect(timeout=" in waiting and "0:00:01" in waiting
    assert results[0]["error"].startswith("CheckpointError"), results[0]["error"]
    assert all(r["listed"] == [] for r in results)  # nothing committed


def test_an_unstorable_rank_extras_value_on_one_rank_fails_every_rank_alike(tmp_path: Path) -> None:
    """The ranks agree before one fails, so both raise and the group lives on."""
    results = harness.run(cw.unstorable_rank_extras, world_size=2, root=str(tmp_path), timeout=60)
    assert all(r["error"].startswith("CheckpointError") for r in results), [r["error"] for r in results]
    assert "rank_extras" in results[1]["error"] and "failed on 1 other rank" in results[0]["error"]
    assert [r["sum"] for r in results] == [2.0, 2.0]
    assert len({r["after"] for r in results}) == 1
