"""checkpoint / restore in one process: exact round trips, exact resumes, layout, rotation.

The laws: restoring a checkpoint into fresh objects gives back every tensor,
hyperparameter, value and random generator bit for bit; and training on after
a restore gives the same parameters, bit for bit, as never stopping.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.distributed import checkpoint_workers as cw
from tests.strategies import checkpoint_specs, plain_trees


@pytest.fixture(autouse=True)
def _keep_global_generators() -> Any:
    """restore() sets the process's generators on purpose; give other tests theirs back."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])
    torch.use_deterministic_algorithms(deterministic)


def _with_extras(spec: dict, seed: int, values: Any, *, placeholders: bool = False) -> Any:
    """A TrainState whose extras hold a value tree, a tensor pytree and a stateful object."""
    import faccel

    model, optimizer, scheduler, scaler = cw.build(spec, seed=seed)
    g = torch.Generator().manual_seed(seed)
    extras = {
        "values": None if placeholders else values,
        "params": {"w": torch.randn(3, generator=g), "b": (torch.randn(2, 2, generator=g).t(), 7)},
        "ema": cw.Net(spec),  # an object with state_dict/load_state_dict, loaded in place
        "flags": {"best": None} if placeholders else {"best": float("inf"), "betas": (0.9, 0.99)},
    }
    state = faccel.TrainState.create(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, extras=extras
    )
    return state


@given(spec=checkpoint_specs(), steps=st.integers(min_value=0, max_value=4), values=plain_trees)
@settings(max_examples=30)
def test_restore_into_fresh_objects_gives_back_every_bit(spec: dict, steps: int, values: Any) -> None:
    import faccel

    dist = faccel.detect({})
    state = _with_extras(spec, 0, values)
    model, optimizer, loader = faccel.prepare(dist, state.model, state.optimizer, cw.data(spec))
    cw.seed_generators(0, 5)
    state = cw.train(dist, attrs.evolve(state, model=model, optimizer=optimizer), loader, until=steps)
    state = attrs.evolve(state, step=state.step + 1000)  # step is a value, not a count of calls
    saved = cw.observe(state)
    with tempfile.TemporaryDirectory() as root:
        folder = faccel.checkpoint(dist, state, root)
        assert folder.name == f"step-{state.step:012d}"
        cw.seed_generators(0, 77)
        target = _with_extras(spec, 1, None, placeholders=True)
        restored = faccel.restore(dist, target, root)
    got = cw.observe(restored)
    cw.assert_same(got, saved)  # tensors, hyperparameters (tuples stay tuples), values, generators
    assert restored is not target and target.step == 0  # a new record; the old one unchanged
    assert restored.extras["ema"] is target.extras["ema"]  # loaded in place
    assert restored.model is target.model and restored.optimizer is target.optimizer
    if spec["tied"]:
        assert target.model.tied.weight is target.model.hidden[0].weight


@given(spec=checkpoint_specs(), data=st.data())
@settings(max_examples=25)
def test_training_on_after_restore_equals_never_stopping(spec: dict, data: st.DataObject) -> None:
    stops = data.draw(
        st.lists(st.integers(min_value=0, max_value=spec["total_steps"]), min_size=1, max_size=3)
    )
    with tempfile.TemporaryDirectory() as root:
        result = cw.resume_cases(spec, sorted(set(stops)), root, env={})
    for stop, case in result["resumed"].items():
        assert case["restored"] == case["expected"], stop
        assert case["digest"] == result["reference"], f"resumed at step {stop} diverged"


def test_mid_epoch_and_epoch_end_stops_resume_exactly() -> None:
    spec = cw.example_spec(batchnorm=False)  # 22 samples, batch 4: 6 batches an epoch
    with tempfile.TemporaryDirectory() as root:
        result = cw.resume_cases(spec, [3, 6, 8], root, env={})
    assert result["resumed"]["3"]["restored"] == [3, 0, 3]  # mid-epoch
    assert result["resumed"]["6"]["restored"] == [6, 0, 6]  # the epoch's last batch consumed
    assert result["resumed"]["8"]["restored"] == [8, 1, 2]  # mid-epoch of the next epoch
    assert {case["digest"] for case in result["resumed"].values()} == {result["reference"]}


@pytest.mark.parametrize("forget", ["python", "numpy", "torch", "position"])
def test_the_resume_law_has_teeth(tmp_path: Path, forget: str) -> None:
    """Control: dropping any one restored piece makes the resumed run differ."""
    import faccel

    torch.use_deterministic_algorithms(True)
    dist = faccel.detect({})
    spec = cw.example_spec()
    state, loader = cw.fresh(dist, spec, seed=0)
    cw.seed_generators(0, 100)
    reference = cw.digest(cw.train(dist, state, loader, until=9))
    state, loader = cw.fresh(dist, spec, seed=0)
    cw.seed_generators(0, 100)
    faccel.checkpoint(dist, cw.train(dist, state, loader, until=4), tmp_path)
    target, loader = cw.fresh(dist, spec, seed=1)
    restored = faccel.restore(dist, target, tmp_path)
    if forget == "python":
        random.seed(1)
    elif forget == "numpy":
        np.random.seed(1)
    elif forget == "torch":
        torch.manual_seed(1)
    else:
        restored = attrs.evolve(restored, position=0)
    assert cw.digest(cw.train(dist, restored, loader, until=9)) != reference


def test_the_loader_resumes_without_reading_skipped_batches(tmp_path: Path) -> None:
    """loader.at(epoch=state.epoch, start=state.position): the rest of the epoch, nothing fetched twice."""
    import faccel

    fetched: list[int] = []

    class Recording(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 20

        def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            fetched.append(index)
            return torch.full((4,), float(index)), torch.zeros(1)

    dist = faccel.detect({})
    loader = faccel.prepare(dist, torch.utils.data.DataLoader(Recording(), batch_size=3, shuffle=True))
    whole = [int(i) for x, _ in loader.at(epoch=2) for i in x[:, 0].tolist()]
    fetched.clear()
    model = torch.nn.Linear(4, 1)
    state = faccel.TrainState.create(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), epoch=2, position=0
    )
    batches = iter(loader.at(epoch=state.epoch, start=state.position))
    for _ in range(3):
        next(batches)
        state = attrs.evolve(state, step=state.step + 1, position=state.position + 1)
    faccel.checkpoint(dist, state, tmp_path)
    seen_before = list(fetched)
    fetched.clear()
    restored = faccel.restore(dist, state, tmp_path)
    rest = [
        int(i) for x, _ in loader.at(epoch=restored.epoch, start=restored.position) for i in x[:, 0].tolist()
    ]
    assert seen_before + rest == whole
    assert fetched == rest  # the skipped batches were never read again


def test_keep_rotates_and_leaves_no_partial_folders(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(1, 6):
        faccel.checkpoint(dist, attrs.evolve(state, step=step), tmp_path, keep=2)
    assert sorted(os.listdir(tmp_path)) == ["step-000000000004", "step-000000000005"]
    assert faccel.latest_checkpoint(tmp_path) == tmp_path / "step-000000000005"
    # A later step written after a restore of an older one never deletes the newer folders.
    faccel.checkpoint(dist, attrs.evolve(state, step=2), tmp_path, keep=1)
    assert sorted(os.listdir(tmp_path)) == ["step-000000000002", "step-000000000004", "step-000000000005"]
    with pytest.raises(faccel.errors.ArgumentValueError, match="keep"):
        faccel.checkpoint(dist, state, tmp_path, keep=0)


def test_the_same_step_twice_is_refused_unless_replace_is_asked(tmp_path: Path) -> None:
    # Was test_the_same_step_twice_replaces_the_checkpoint: a forgotten step advance silently
    # overwrote step 0 every time. Now it is refused, and replacing is an explicit choice.
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=3
    )
    first = faccel.checkpoint(dist, state, tmp_path)
    before = {name: (first / name).read_bytes() for name in os.listdir(first)}
    with torch.no_grad():
        model.weight.fill_(7.0)
    with pytest.raises(faccel.errors.CheckpointError, match="step 3 already exists") as caught:
        faccel.checkpoint(dist, attrs.evolve(state, position=1), tmp_path)
    assert "attrs.evolve(state, step=state.step + 1" in str(caught.value)
    assert "replace=True" in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == ["step-000000000003"]  # untouched, nothing left over
    assert {name: (first / name).read_bytes() for name in os.listdir(first)} == before
    faccel.checkpoint(dist, attrs.evolve(state, position=1), tmp_path, replace=True)
    assert sorted(os.listdir(tmp_path)) == ["step-000000000003"]
    fresh = torch.nn.Linear(2, 2)
    restored = faccel.restore(
        dist,
        faccel.TrainState.create(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1)),
        tmp_path,
    )
    assert restored.position == 1 and torch.all(fresh.weight == 7.0)


def test_a_loop_that_never_advances_the_step_stops_at_its_second_checkpoint(tmp_path: Path) -> None:
    """The README's old fragment: epochs advance, the step never does."""
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    faccel.checkpoint(dist, attrs.evolve(state, epoch=1), tmp_path, keep=1)
    with pytest.raises(faccel.errors.CheckpointError, match="advance the step"):
        faccel.checkpoint(dist, attrs.evolve(state, epoch=2), tmp_path, keep=1)
    assert faccel.restore(dist, state, tmp_path).epoch == 1


def test_a_path_that_is_a_file_gets_a_named_error(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    file = tmp_path / "ckpt.pt"
    file.write_bytes(b"not a folder")
    for path in (file, file / "run1"):
        with pytest.raises(faccel.errors.CheckpointError, match="is a file, not a folder") as caught:
            faccel.checkpoint(dist, state, path)
        assert str(file) in str(caught.value) and "Errno" not in str(caught.value)
        with pytest.raises(faccel.errors.StorageError, match="is a file, not a folder") as stored:
            faccel.save_model(dist, model, path)
        assert str(file) in str(stored.value) and "Errno" not in str(stored.value)
    assert file.read_bytes() == b"not a folder"


def test_latest_checkpoint_counts_only_complete_ones(tmp_path: Path) -> None:
    import faccel

    assert faccel.latest_checkpoint(tmp_path / "missing") is None
    assert faccel.latest_checkpoint(tmp_path) is None
    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=4
    )
    done = faccel.checkpoint(dist, state, tmp_path)
    (tmp_path / ".tmp-step-000000000009").mkdir()  # an interrupted write
    (tmp_path / "step-000000000008").mkdir()  # no manifest: not a checkpoint
    (tmp_path / "step-000000000007").mkdir()
    (tmp_path / "step-000000000007" / "manifest.json").write_text('{"format": "other", "step": 7}')
    assert faccel.latest_checkpoint(tmp_path) == done
    assert faccel.latest_checkpoint(done) == done
    with pytest.raises(faccel.errors.CheckpointError, match="no checkpoint there"):
        faccel.restore(dist, state, tmp_path / "step-000000000008")


def test_every_file_is_json_or_safetensors_and_the_weights_load_anywhere(tmp_path: Path) -> None:
    import safetensors

    import faccel

    dist = faccel.detect({})
    spec = cw.example_spec()
    state, loader = cw.fresh(dist, spec, seed=0)
    folder = faccel.checkpoint(dist, cw.train(dist, state, loader, until=2), tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "faccel.checkpoint" and manifest["version"] == 3
    assert all(set(entry) == {"size", "blake3"} for entry in manifest["files"].values())
    assert set(manifest["files"]) | {"manifest.json"} == set(os.listdir(folder))
    for name in os.listdir(folder):
        path = folder / name
        if name.endswith(".json"):
            json.loads(path.read_text())
        else:
            with safetensors.safe_open(path, framework="pt") as handle:
                list(handle.keys())
        assert not path.read_bytes().startswith(b"\x80")  # no pickle protocol header
    # The checkpoint's model file is a Hugging Face model.safetensors.
    target, _, _, _ = cw.build(spec, seed=1)
    faccel.load_model(dist, target, folder)
    cw.assert_same(dict(target.state_dict()), dict(faccel.unwrap_model(state.model).state_dict()))


def test_a_version_1_checkpoint_with_sha256_records_still_restores_and_consolidates(tmp_path: Path) -> None:
    """Version 1 is version 3's files under SHA-256 records: what an earlier faccel wrote."""
    import faccel
    from faccel._hf._consolidate import consolidate
    from faccel.errors import CheckpointError
    from tests import manifests

    dist = faccel.detect({})
    spec = cw.example_spec()
    state, loader = cw.fresh(dist, spec, seed=0)
    trained = cw.train(dist, state, loader, until=2)
    folder = faccel.checkpoint(dist, trained, tmp_path / "root")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["version"] = 1
    for name in manifest["files"]:
        manifest["files"][name] = manifests.entry_of(manifest, (folder / name).read_bytes())
    assert all(set(entry) == {"size", "sha256"} for entry in manifest["files"].values())
    (folder / "manifest.json").write_text(json.dumps(manifest))
    fresh, _ = cw.fresh(dist, spec, seed=5)
    restored = faccel.restore(dist, fresh, folder)
    cw.assert_same(dict(restored.model.state_dict()), dict(trained.model.state_dict()))
    cw.assert_same(restored.optimizer.state_dict(), trained.optimizer.state_dict())
    consolidate(folder, tmp_path / "export")
    target, _, _, _ = cw.build(spec, seed=1)
    faccel.load_model(dist, target, tmp_path / "export")
    cw.assert_same(dict(target.state_dict()), dict(faccel.unwrap_model(trained.model).state_dict()))
    # Its records are checked as SHA-256: a flipped byte is named so.
    data = bytearray((folder / "optimizer.safetensors").read_bytes())
    data[-1] ^= 1
    (folder / "optimizer.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors: the sha256 checksum differs"):
        faccel.restore(dist, cw.fresh(dist, spec, seed=5)[0], folder)


def test_values_without_a_pickle_free_form_are_refused_before_any_file(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), extras={"hook": print}
    )
    with pytest.raises(faccel.errors.CheckpointError, match=r"extras\.hook"):
        faccel.checkpoint(dist, state, tmp_path / "root")
    assert not (tmp_path / "root").exists()


def test_train_state_is_a_frozen_record() -> None:
    import faccel

    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        state.step = 3  # type: ignore[misc]
    assert attrs.evolve(state, step=3).step == 3 and state.step == 0
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"TrainState.position must be .* got -1"):
        attrs.evolve(state, position=-1)
    with pytest.raises(faccel.errors.ArgumentError, match=r"TrainState.step must be an int >= 0, got True"):
        attrs.evolve(state, step=True)
    with pytest.raises(faccel.errors.ArgumentError, match="strings"):
        attrs.evolve(state, extras={1: "x"})


def test_restore_at_another_world_size_needs_the_global_position_mid_epoch(tmp_path: Path) -> None:
    # Was test_restore_needs_the_same_world_size: any world size restores now, an epoch
    # boundary as it is, a position inside an epoch only where the checkpoint records it globally.
    import faccel

    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    faccel.checkpoint(faccel.detect({}), state, tmp_path)
    two = faccel.DistState.simulated(world_size=2)
    assert faccel.restore(two, state, tmp_path).position == 0
    faccel.checkpoint(faccel.detect({}), attrs.evolve(state, step=1, position=2), tmp_path)
    with pytest.raises(faccel.errors.CheckpointError, match="does not record the global position"):
        faccel.restore(two, state, tmp_path)
    with pytest.raises(faccel.errors.ArgumentValueError, match="simulated"):
        faccel.checkpoint(faccel.DistState.simulated(world_size=2), state, tmp_path)


def test_file_system_errors_become_checkpoint_errors(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    # A path that is a file has its own error now (test_a_path_that_is_a_file_gets_a_named_error);
    # a name longer than the file system allows is the operating system's refusal here.
    too_long = tmp_path / ("x" * 300)
    with pytest.raises(faccel.errors.CheckpointError, match="preparing the checkpoint of step 0 failed"):
        faccel.checkpoint(dist, state, too_long)
    # save_model is not a checkpoint: its failed write is a StorageError, an OSError by kind.
    with pytest.raises(faccel.errors.StorageError, match="save_model failed") as error:
        faccel.save_model(dist, model, too_long)
    assert isinstance(error.value, OSError) and isinstance(error.value.__cause__, OSError)
    assert not isinstance(error.value, faccel.errors.CheckpointError)


def test_a_state_without_a_torch_optimizer_round_trips_and_mismatches_are_named(tmp_path) -> None:
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(3, 2)
    state = faccel.TrainState.create(model=model, optimizer=None, step=4, extras={"m": torch.ones(2)})
    faccel.checkpoint(dist, state, tmp_path)
    fresh = torch.nn.Linear(3, 2)
    target = faccel.TrainState.create(model=fresh, optimizer=None, extras={"m": torch.zeros(2)})
    restored = faccel.restore(dist, target, tmp_path)
    assert restored.step == 4 and torch.equal(fresh.weight, model.weight)
    assert torch.equal(restored.extras["m"], torch.ones(2))
    with_optimizer = faccel.TrainState.create(
        model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1), extras={"m": torch.zeros(2)}
    )
    with pytest.raises(faccel.errors.CheckpointError, match="no optimizer was saved"):
        faccel.restore(dist, with_optimizer, tmp_path)


def test_the_readme_loop_counts_steps_and_resumes_after_the_last_epoch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's loop fragment (not run by test_docs: it needs a model) runs as written, twice."""
    import re

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    fragment = re.search(r"## The loop\n.*?```python\n(.*?)```", readme, re.S).group(1)
    monkeypatch.chdir(tmp_path)

    def run(epochs: int) -> dict:
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.randn(12, 2), torch.randn(12, 1))
        namespace = {
            "model": model,
            "optimizer": optimizer,
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=2),
            "loader": torch.utils.data.DataLoader(data, batch_size=4, shuffle=True),
            "loss_function": torch.nn.functional.mse_loss,
            "epochs": epochs,
        }
        exec(compile(fragment, "README.md#the-loop", "exec"), namespace)
        return namespace

    first = run(epochs=2)
    assert (first["state"].step, first["state"].epoch) == (6, 2)  # 3 batches an epoch, counted
    assert sorted(os.listdir("ckpt")) == ["step-000000000003", "step-000000000006"]
    again = run(epochs=3)  # a new process: resumes after epoch 1, trains epoch 2 only
    assert (again["state"].step, again["state"].epoch, again["state"].position) == (9, 3, 0)
    assert sorted(os.listdir("ckpt")) == ["step-000000000006", "step-000000000009"]


def test_a_resume_from_an_older_checkpoint_into_a_root_with_later_ones_is_stopped_at_restore(
    tmp_path: Path,
) -> None:
    """Before: the run trained on and failed at its first checkpoint that collided (step 10, hours in)."""
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    for step in (10, 20):
        faccel.checkpoint(dist, attrs.evolve(state, step=step), tmp_path)
    older = tmp_path / "step-000000000010"
    with pytest.raises(
        faccel.errors.CheckpointError, match=r"also holds later checkpoints \(step-000000000020\)"
    ):
        faccel.restore(dist, state, older)
    assert torch.equal(model.weight, state.model.weight)  # nothing loaded
    # The choices work: a new root holding only that folder restores and checkpoints on.
    fresh_root = tmp_path.parent / f"{tmp_path.name}-fresh"
    shutil.copytree(older, fresh_root / older.name)
    restored = faccel.restore(dist, state, fresh_root / older.name)
    assert restored.step == 10
    faccel.checkpoint(dist, attrs.evolve(restored, step=11), fresh_root)


@pytest.mark.parametrize("first_step", [0, 10, 25])
def test_a_fresh_run_into_a_root_with_later_checkpoints_stops_at_its_first_checkpoint(
    tmp_path: Path, first_step: int
) -> None:
    # a re-run into an old output folder used to train on until its first step that
    # collided (step 10 or 30 here), hours in a real run; now its first checkpoint, whatever its
    # step, is refused when the root holds later ones, and nothing is written.
    import faccel

    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    earlier_run = faccel.detect({})
    for step in (10, 20, 30):
        faccel.checkpoint(earlier_run, attrs.evolve(state, step=step), tmp_path)
    before = sorted(os.listdir(tmp_path))
    rerun = faccel.detect({})  # a new process's run: it has not written into this root
    with pytest.raises(faccel.errors.CheckpointError, match="already holds later checkpoints") as caught:
        faccel.checkpoint(rerun, attrs.evolve(state, step=first_step), tmp_path)
    later = [f"step-{s:012d}" for s in (10, 20, 30) if s > first_step]
    assert all(name in str(caught.value) for name in later), caught.value
    assert "replace=True" in str(caught.value) and "faccel.restore" in str(caught.value)
    assert sorted(os.listdir(tmp_path)) == before  # nothing written, nothing removed
    # The choices: replace=True overwrites the future as the run reaches it ...
    replaced = faccel.checkpoint(rerun, attrs.evolve(state, step=first_step), tmp_path, replace=True)
    assert replaced.name == f"step-{first_step:012d}" and (replaced / "manifest.json").is_file()
    # ... and a run that resumed from the root's latest checkpoints on with no refusal.
    resumed = faccel.detect({})
    restored = faccel.restore(resumed, state, tmp_path)
    faccel.checkpoint(resumed, attrs.evolve(restored, step=restored.step + 1), tmp_path)


def test_later_checkpoints_are_checked_once_per_root_not_at_every_checkpoint(tmp_path: Path) -> None:
    # The run's own later folders (written before a rewind to an older step, as the keep test does)
    # are its own: only the first checkpoint into a root looks for another run's future.
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    faccel.checkpoint(dist, attrs.evolve(state, step=5), tmp_path)
    faccel.checkpoint(dist, attrs.evolve(state, step=2), tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["step-000000000002", "step-000000000005"]
