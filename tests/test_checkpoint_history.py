"""Named checkpoints, restoring an older checkpoint into a new root, and rollback.

Before: folders were always ``root/step-N``; restoring an older step of a root that holds later
ones was refused even when the run checkpoints into a new root, with no opt-out; rolling back
needed a copy of the folder. The two-rank versions are in tests/distributed/test_checkpoint_history.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest
import torch

import faccel


def _state(seed: int = 0) -> faccel.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(2, 2)
    return faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _weights(state: faccel.TrainState) -> torch.Tensor:
    return state.model.weight.detach().clone()


def test_a_named_checkpoint_sits_beside_the_numbered_ones_and_is_never_the_latest(tmp_path: Path) -> None:
    dist = faccel.detect({})
    state = _state()
    faccel.checkpoint(dist, attrs.evolve(state, step=3), tmp_path)
    with torch.no_grad():
        state.model.weight.add_(1.0)
    best = faccel.checkpoint(dist, attrs.evolve(state, step=2), tmp_path, name="best")
    assert best == tmp_path / "best" and (best / "manifest.json").is_file()
    faccel.checkpoint(dist, attrs.evolve(state, step=4), tmp_path, keep=1)  # rotates step 3, not best
    assert sorted(os.listdir(tmp_path)) == ["best", "step-000000000004"]
    assert faccel.latest_checkpoint(tmp_path) == tmp_path / "step-000000000004"
    target = _state(seed=1)
    # Step 2 < 4: a run resumed from it would meet step 4 in this root, so it names its own root.
    with pytest.raises(faccel.errors.CheckpointError, match=r"into=new_root"):
        faccel.restore(dist, _state(1), best)
    restored = faccel.restore(dist, target, best, into=tmp_path.parent / f"{tmp_path.name}-eval")
    assert restored.step == 2 and torch.equal(_weights(target), _weights(state))


def test_a_named_checkpoint_is_replaced_only_when_asked(tmp_path: Path) -> None:
    dist = faccel.detect({})
    state = _state()
    faccel.checkpoint(dist, attrs.evolve(state, step=1), tmp_path, name="epoch_0")
    with pytest.raises(faccel.errors.CheckpointError, match="named 'epoch_0' already exists"):
        faccel.checkpoint(dist, attrs.evolve(state, step=5), tmp_path, name="epoch_0")
    faccel.checkpoint(dist, attrs.evolve(state, step=5), tmp_path, name="epoch_0", replace=True)
    assert faccel.restore(dist, _state(1), tmp_path / "epoch_0").step == 5
    assert sorted(os.listdir(tmp_path)) == ["epoch_0"]


@pytest.mark.parametrize("name", ["", "step-000000000001", ".hidden", "a/b", "..", "x" * 129, "a b"])
def test_a_name_that_is_not_one_plain_folder_is_refused_before_anything_is_written(
    tmp_path: Path, name: str
) -> None:
    with pytest.raises(faccel.errors.ArgumentValueError, match="not one plain folder name"):
        faccel.checkpoint(faccel.detect({}), _state(), tmp_path / "root", name=name)
    assert not (tmp_path / "root").exists()


def test_keep_with_a_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(faccel.errors.ArgumentValueError, match="never a named one"):
        faccel.checkpoint(faccel.detect({}), _state(), tmp_path, name="best", keep=2)


def test_an_interrupted_replace_of_a_named_checkpoint_is_settled_by_the_next_write(tmp_path: Path) -> None:
    dist = faccel.detect({})
    state = _state()
    faccel.checkpoint(dist, attrs.evolve(state, step=1), tmp_path, name="best")
    os.rename(tmp_path / "best", tmp_path / ".replaced-best")  # a crash between the two renames
    (tmp_path / ".tmp-best").mkdir()  # and a dead writer's temporary folder
    faccel.checkpoint(dist, attrs.evolve(state, step=2), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["best", "step-000000000002"]
    assert faccel.latest_checkpoint(tmp_path) == tmp_path / "step-000000000002"


def test_an_older_checkpoint_restores_into_a_new_root_and_checkpoints_there(tmp_path: Path) -> None:
    dist = faccel.detect({})
    old, new = tmp_path / "old", tmp_path / "new"
    state = _state()
    for step in (10, 20):
        faccel.checkpoint(dist, attrs.evolve(state, step=step), old)
    restored = faccel.restore(dist, _state(1), old / "step-000000000010", into=new)
    assert restored.step == 10
    faccel.checkpoint(faccel.detect({}), attrs.evolve(restored, step=11), new)
    assert sorted(os.listdir(old)) == ["step-000000000010", "step-000000000020"]  # only read
    assert sorted(os.listdir(new)) == ["step-000000000011"]


def test_into_a_root_that_holds_later_checkpoints_is_refused_before_anything_is_loaded(
    tmp_path: Path,
) -> None:
    dist = faccel.detect({})
    state = _state()
    faccel.checkpoint(dist, attrs.evolve(state, step=10), tmp_path / "a")
    faccel.checkpoint(dist, attrs.evolve(state, step=30), tmp_path / "b")
    target = _state(1)
    before = _weights(target)
    with pytest.raises(faccel.errors.CheckpointError, match=r"already holds checkpoints after step 10"):
        faccel.restore(dist, target, tmp_path / "a" / "step-000000000010", into=tmp_path / "b")
    assert torch.equal(_weights(target), before)


def test_rollback_moves_the_later_checkpoints_aside_only_when_asked(tmp_path: Path) -> None:
    dist = faccel.detect({})
    state = _state()
    for step in (10, 20, 30):
        with torch.no_grad():
            state.model.weight.add_(1.0)
        faccel.checkpoint(dist, attrs.evolve(state, step=step), tmp_path)
    (tmp_path / "step-000000000040").mkdir()  # a damaged later one is set aside too
    with pytest.raises(faccel.errors.CheckpointError, match="rollback='move'"):
        faccel.restore(dist, _state(1), tmp_path / "step-000000000010")
    assert len(os.listdir(tmp_path)) == 4  # nothing moved unasked
    target = _state(1)
    restored = faccel.restore(dist, target, tmp_path / "step-000000000010", rollback="move")
    assert restored.step == 10
    aside = tmp_path / "abandoned-after-step-000000000010"
    assert sorted(os.listdir(tmp_path)) == [aside.name, "step-000000000010"]
    assert sorted(os.listdir(aside)) == ["step-000000000020", "step-000000000030", "step-000000000040"]
    # The run goes on in the same root: its next checkpoint is not refused, and is the latest.
    again = faccel.detect({})
    faccel.checkpoint(again, attrs.evolve(restored, step=11), tmp_path)
    assert faccel.latest_checkpoint(tmp_path) == tmp_path / "step-000000000011"
    # A moved checkpoint is whole: it restores from its new place.
    assert faccel.restore(again, _state(2), aside / "step-000000000030", into=tmp_path / "x").step == 30


def test_rollback_delete_removes_the_later_checkpoints(tmp_path: Path) -> None:
    dist = faccel.detect({})
    state = _state()
    for step in (1, 2, 3):
        faccel.checkpoint(dist, attrs.evolve(state, step=step), tmp_path)
    assert faccel.restore(dist, _state(1), tmp_path / "step-000000000002", rollback="delete").step == 2
    assert sorted(os.listdir(tmp_path)) == ["step-000000000001", "step-000000000002"]


def test_rollback_of_a_broken_checkpoint_moves_nothing(tmp_path: Path) -> None:
    dist = faccel.detect({})
    state = _state()
    for step in (1, 2):
        faccel.checkpoint(dist, attrs.evolve(state, step=step), tmp_path)
    (tmp_path / "step-000000000001" / "state.json").write_text("{}")
    with pytest.raises(faccel.errors.CheckpointError):
        faccel.restore(dist, _state(1), tmp_path / "step-000000000001", rollback="move")
    assert sorted(os.listdir(tmp_path)) == ["step-000000000001", "step-000000000002"]


def test_rollback_and_into_are_checked_before_anything(tmp_path: Path) -> None:
    dist = faccel.detect({})
    faccel.checkpoint(dist, _state(), tmp_path)
    with pytest.raises(faccel.errors.ArgumentValueError, match="pass one of them"):
        faccel.restore(dist, _state(), tmp_path, into=tmp_path / "x", rollback="move")
    with pytest.raises(faccel.errors.CheckpointError, match="not the root"):
        faccel.restore(dist, _state(), tmp_path, rollback="move")


@pytest.mark.parametrize(
    "name",
    ["step-1", "step-0000000000001", "manifest.json", "state.json", "abandoned-after-step-000000000002"],
)
def test_a_name_faccel_gives_things_in_a_root_is_refused_before_anything_is_written(
    tmp_path: Path, name: str
) -> None:
    said = r"is a name faccel gives things|not one plain"
    with pytest.raises(faccel.errors.ArgumentValueError, match=said):
        faccel.checkpoint(faccel.detect({}), _state(), tmp_path / "root", name=name)
    assert not (tmp_path / "root").exists()


def test_into_a_regular_file_is_refused_before_anything_is_loaded(tmp_path: Path) -> None:
    dist = faccel.detect({})
    faccel.checkpoint(dist, attrs.evolve(_state(), step=1), tmp_path / "a")
    (tmp_path / "file").write_text("x")
    target = _state(1)
    before = _weights(target)
    with pytest.raises(
        faccel.errors.CheckpointError, match=r"file is a file, so no checkpoint can be written"
    ):
        faccel.restore(dist, target, tmp_path / "a" / "step-000000000001", into=tmp_path / "file")
    assert torch.equal(_weights(target), before) and (tmp_path / "file").read_text() == "x"
