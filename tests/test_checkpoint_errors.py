"""Broken, foreign and mismatched checkpoints: one CheckpointError naming the file, nothing modified.

Each case damages a fresh checkpoint (re-hashing the manifest where the point
is a *consistent but wrong* file rather than a checksum failure), restores
into fresh objects, and compares everything a checkpoint touches (weights,
optimizer, scheduler, scaler, extras, generators) before and after.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests import manifests
from tests.distributed import checkpoint_workers as cw

Edit = Callable[[Path], None]


pytestmark = pytest.mark.usefixtures("keep_global_generators")  # restore sets the global generators


def _state(seed: int, **changes: Any) -> Any:
    import faccel

    spec = cw.example_spec(**changes)
    model, optimizer, scheduler, scaler = cw.build(spec, seed=seed)
    extras = {"ema": torch.full((3,), float(seed)), "note": "x", "counts": {"a": (1, 2)}}
    return faccel.TrainState.create(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, extras=extras
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import faccel

    dist = faccel.detect({})
    state = _state(0)
    model, optimizer, loader = faccel.prepare(dist, state.model, state.optimizer, cw.data(cw.example_spec()))
    state = cw.train(dist, attrs.evolve(state, model=model, optimizer=optimizer), loader, until=3)
    return faccel.checkpoint(dist, state, tmp_path_factory.mktemp("saved"))


@pytest.fixture
def folder(saved: Path, tmp_path: Path) -> Path:
    copy = tmp_path / saved.name
    shutil.copytree(saved, copy)
    return copy


def _edit_tensors(name: str, change: Callable[[dict[str, torch.Tensor]], None]) -> Edit:
    def edit(folder: Path) -> None:
        import safetensors.torch

        from faccel._storage._safetensors import plan

        tensors = dict(safetensors.torch.load_file(folder / name))
        change(tensors)
        metadata = {"format": "pt"} if name == "model.safetensors" else None
        (folder / name).write_bytes(
            b"".join(bytes(memoryview(c).cast("B")) for c in plan(tensors, metadata=metadata))
        )
        manifests.rehash(folder, name)

    return edit


def _edit_json(name: str, change: Callable[[Any], None], *, rehash: bool = True) -> Edit:
    def edit(folder: Path) -> None:
        content = json.loads((folder / name).read_text())
        change(content)
        (folder / name).write_text(json.dumps(content))
        if rehash and name != "manifest.json":
            manifests.rehash(folder, name)

    return edit


def _truncate(name: str) -> Edit:
    def edit(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: len(data) // 2])

    return edit


def _flip(name: str, where: float = 0.7) -> Edit:
    def edit(folder: Path) -> None:
        data = bytearray((folder / name).read_bytes())
        data[int(len(data) * where)] ^= 0x10
        (folder / name).write_bytes(bytes(data))

    return edit


def _delete(name: str) -> Edit:
    return lambda folder: (folder / name).unlink()


def _set(key: str, value: Any) -> Callable[[Any], None]:
    def change(content: Any) -> None:
        content[key] = value

    return change


def _class_to_sgd(content: Any) -> None:
    content["optimizer"]["class"] = "torch.optim.sgd.SGD"


def _drop_group(content: Any) -> None:
    content["optimizer"]["state_dict"]["param_groups"].pop()


def _bad_tag(content: Any) -> None:
    content["extras"]["note"]["value"] = {"__tuple__": "not a list"}


def _bad_python_rng(content: Any) -> None:
    content["python"] = {"__tuple__": [3, {"__tuple__": [1, 2]}, None]}


def _double(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors[key].double()

    return change


def _reshape(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = tensors[key].reshape(-1)

    return change


def _add(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        tensors[key] = torch.zeros(2)

    return change


def _drop(key: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def change(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[key]

    return change


CASES: dict[str, tuple[Edit, str, str]] = {
    # name: (damage, file the error must name, words it must say)
    "truncated weights": (_truncate("model.safetensors"), "model.safetensors", "truncated"),
    "flipped optimizer byte": (_flip("optimizer.safetensors"), "optimizer.safetensors", "checksum"),
    "flipped header byte": (_flip("model.safetensors", 0.01), "model.safetensors", "checksum"),
    "flipped state byte": (_flip("state.json", 0.5), "state.json", "checksum"),
    "deleted extras": (_delete("extras.safetensors"), "extras.safetensors", "missing"),
    "deleted rng": (_delete("rng-00000.json"), "rng-00000.json", "missing"),
    "deleted state": (_delete("state.json"), "state.json", "missing"),
    "deleted manifest": (_delete("manifest.json"), "manifest.json", "no checkpoint there"),
    # Version 2 is the sharded format: a version beyond what this faccel reads.
    "version bumped": (_edit_json("manifest.json", _set("version", 4)), "manifest.json", "version 4"),
    "foreign manifest": (
        _edit_json("manifest.json", _set("format", "x")),
        "manifest.json",
        "no valid manifest",
    ),
    "manifest lists a pickle": (
        _edit_json(
            "manifest.json", lambda m: m["files"].update({"optimizer.bin": {"size": 1, "sha256": ""}})
        ),
        "manifest.json",
        "lists files",
    ),
    "manifest not json": (
        lambda f: (f / "manifest.json").write_text("{"),
        "manifest.json",
        "no checkpoint there",
    ),
    "weight reshaped": (
        _edit_tensors("model.safetensors", _reshape("inp.weight")),
        "model.safetensors",
        "shape",
    ),
    "weight retyped": (_edit_tensors("model.safetensors", _double("inp.bias")), "model.safetensors", "dtype"),
    "weight added": (
        _edit_tensors("model.safetensors", _add("new.weight")),
        "model.safetensors",
        "does not list",
    ),
    "weight dropped": (_edit_tensors("model.safetensors", _drop("inp.bias")), "model.safetensors", "missing"),
    "optimizer tensor added": (
        _edit_tensors("optimizer.safetensors", _add("state.99.exp_avg")),
        "optimizer.safetensors",
        "does not mention",
    ),
    "optimizer tensor dropped": (
        _edit_tensors("optimizer.safetensors", _drop("state.0.exp_avg")),
        "optimizer.safetensors",
        "missing",
    ),
    "optimizer state reshaped": (
        _edit_tensors("optimizer.safetensors", _reshape("state.0.exp_avg")),
        "optimizer.safetensors",
        "the parameter is",
    ),
    "optimizer state retyped": (
        _edit_tensors("optimizer.safetensors", _double("state.1.exp_avg_sq")),
        "optimizer.safetensors",
        "the parameter is",
    ),
    "extras tensor reshaped": (
        _edit_tensors("extras.safetensors", _double("extras.ema")),
        "extras.safetensors",
        "extras['ema']",
    ),
    "optimizer class": (_edit_json("state.json", _class_to_sgd), "state.json", "is a torch.optim.sgd.SGD"),
    "param group dropped": (_edit_json("state.json", _drop_group), "state.json", "param groups saved"),
    "malformed tag": (_edit_json("state.json", _bad_tag), "state.json", "malformed __tuple__"),
    "state not json": (
        lambda f: ((f / "state.json").write_text("[1,"), manifests.rehash(f, "state.json")),
        "state.json",
        "JSON",
    ),
    "state step negative": (_edit_json("state.json", _set("step", -1)), "state.json", "step must be"),
    "bad python rng": (_edit_json("rng-00000.json", _bad_python_rng), "rng-00000.json", "python generator"),
    "rng of another rank": (_edit_json("rng-00000.json", _set("rank", 1)), "rng-00000.json", "rank 1"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_checkpoints_raise_naming_the_file_and_modify_nothing(folder: Path, case: str) -> None:
    import faccel

    damage, file, words = CASES[case]
    damage(folder)
    target = _state(1)
    cw.seed_generators(0, 42)
    before = cw.observe(target)
    with pytest.raises(faccel.errors.CheckpointError) as error:
        faccel.restore(faccel.detect({}), target, folder)
    message = str(error.value)
    assert file in message, message
    assert words in message, message
    cw.assert_same(cw.observe(target), before)


MISMATCHES: dict[str, tuple[Callable[[], Any], str]] = {
    "wider model": (lambda: _state(1, width=6), "model.safetensors"),
    "untied model": (lambda: _state(1, tied=False), "state.json"),  # one parameter more
    "another optimizer": (lambda: _state(1, optimizer="sgd"), "state.json"),
    "one param group": (lambda: _state(1, groups=1), "state.json"),
    "no scheduler": (lambda: _state(1, scheduler=None), "state.json"),
    "another scheduler": (lambda: _state(1, scheduler="step"), "state.json"),
    "no scaler": (lambda: _state(1, scaler=False), "state.json"),
    "other extras": (lambda: attrs.evolve(_state(1), extras={"ema": torch.zeros(3)}), "state.json"),
    "extras tensor shape": (
        lambda: attrs.evolve(_state(1), extras={**_state(1).extras, "ema": torch.zeros(4)}),
        "extras.safetensors",
    ),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_objects_that_do_not_fit_are_refused_untouched(saved: Path, case: str) -> None:
    import faccel

    build, file = MISMATCHES[case]
    target = build()
    before = cw.observe(target)
    with pytest.raises(faccel.errors.CheckpointError, match="does not fit") as error:
        faccel.restore(faccel.detect({}), target, saved)
    assert file in str(error.value)
    cw.assert_same(cw.observe(target), before)


def test_a_model_folder_is_not_a_checkpoint(tmp_path: Path) -> None:
    import faccel

    target = _state(1)
    faccel.save_model(faccel.detect({}), target.model, tmp_path)
    with pytest.raises(faccel.errors.CheckpointError, match=r"no valid manifest\.json"):
        faccel.restore(faccel.detect({}), target, tmp_path)


class _Payload:
    """Unpickling this runs a shell command that creates a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _refuse(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("restore tried to unpickle")


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, _refuse)
    monkeypatch.setattr(torch, "load", _refuse)
    monkeypatch.setattr(torch.serialization, "load", _refuse)


def test_restore_refuses_pickles_left_in_the_folder_by_name_and_never_opens_them(
    folder: Path, tmp_path: Path, no_unpickling: None
) -> None:
    """A file the manifest does not list is an extra object: named, never read."""
    import faccel

    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Payload(marker))
    for name in ("evil.pkl", "optimizer.bin", "random_states_0.pkl", "scheduler.bin", "pytorch_model.bin"):
        (folder / name).write_bytes(payload)
    target = _state(1)
    before = cw.observe(target)
    with pytest.raises(
        faccel.errors.CheckpointError, match=r"holds evil\.pkl, optimizer\.bin.*does not list"
    ):
        faccel.restore(faccel.detect({}), target, folder)
    assert not marker.exists()
    cw.assert_same(cw.observe(target), before)


@pytest.mark.parametrize("name", ["optimizer.safetensors", "state.json", "rng-00000.json", "manifest.json"])
def test_restore_refuses_pickles_in_place_of_its_files(
    folder: Path, tmp_path: Path, no_unpickling: None, name: str
) -> None:
    import faccel

    marker = tmp_path / "pwned"
    (folder / name).write_bytes(pickle.dumps(_Payload(marker)))
    if name != "manifest.json":
        manifests.rehash(folder, name)
    target = _state(1)
    before = cw.observe(target)
    with pytest.raises(faccel.errors.CheckpointError, match=name.replace(".", r"\.")):
        faccel.restore(faccel.detect({}), target, folder)
    assert not marker.exists()
    cw.assert_same(cw.observe(target), before)


def test_the_checkpoint_modules_never_use_pickle() -> None:
    import faccel

    root = Path(faccel.__file__).parent
    # every module that reads or writes checkpoints or saved models (_storage/_torch_bin.py, the one
    # reader of pickle-format files, is checked by its own tests)
    files = [
        *sorted((root / "_checkpoint").rglob("*.py")),
        *sorted((root / "_hf").glob("*.py")),
        *(path for path in sorted((root / "_storage").glob("*.py")) if path.name != "_torch_bin.py"),
        root / "_train_state.py",
    ]
    assert len(files) > 3
    for file in files:
        module = file.name
        source = file.read_text()
        assert "import pickle" not in source and "torch.load" not in source, module
        assert "broadcast_object_list" not in source.replace("``broadcast_object_list``", ""), module
