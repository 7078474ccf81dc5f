"""save_model / load_model: the Hugging Face layout, shards, ties, errors, and other tools' files."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.distributed.checkpoint_workers import Net, assert_same, build, example_spec
from tests.strategies import checkpoint_specs

# Changed with the shards of each save carry a tag of their own (8 hex digits).
SHARD = re.compile(r"model-[0-9a-f]{8}-(\d{5})-of-(\d{5})\.safetensors")


def _tensors_equal(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert_same(dict(a.state_dict()), dict(b.state_dict()))


@given(spec=checkpoint_specs(), max_shard_size=st.integers(min_value=1, max_value=600))
@settings(max_examples=40)
def test_sharded_layout_is_what_hugging_face_writes_and_reloads_equal(
    spec: dict, max_shard_size: int
) -> None:
    import safetensors

    import faccel

    dist = faccel.detect({})
    model, _, _, _ = build(spec, seed=0)
    with tempfile.TemporaryDirectory() as folder:
        faccel.save_model(dist, model, folder, max_shard_size=max_shard_size)
        files = sorted(os.listdir(folder))
        stored = {k: v for k, v in model.state_dict().items() if not (spec["tied"] and k == "tied.weight")}
        if files == ["model.safetensors"]:
            shards = files
            weight_map = dict.fromkeys(stored, "model.safetensors")
            assert (
                sum(t.numel() * t.element_size() for t in stored.values()) <= max_shard_size
                or len(stored) == 1
            )
        else:
            index = json.loads((Path(folder) / "model.safetensors.index.json").read_text())
            assert set(index) == {"metadata", "weight_map"}
            shards = [f for f in files if SHARD.fullmatch(f)]
            assert files == sorted([*shards, "model.safetensors.index.json"])
            numbers = [SHARD.fullmatch(f).groups() for f in shards]  # type: ignore[union-attr]
            assert [int(k) for k, _ in numbers] == list(range(1, len(shards) + 1))
            assert {int(n) for _, n in numbers} == {len(shards)} and len(shards) > 1
            assert len({f.split("-")[1] for f in shards}) == 1  # one save, one tag
            weight_map = index["weight_map"]
            nbytes = sum(t.numel() * t.element_size() for t in stored.values())
            assert index["metadata"]["total_size"] == nbytes
        # every stored tensor in exactly one shard, as the index says; tied weights once
        seen: dict[str, str] = {}
        for shard in shards:
            with safetensors.safe_open(Path(folder) / shard, framework="pt") as handle:
                assert handle.metadata() == {"format": "pt"}
                for key in handle.keys():  # noqa: SIM118
                    assert key not in seen
                    seen[key] = shard
        assert seen == weight_map and set(seen) == set(stored)
        target, _, _, _ = build(spec, seed=1)
        assert faccel.load_model(dist, target, folder) == ((), ())
        _tensors_equal(model, target)
        if spec["tied"]:
            assert target.tied.weight is target.hidden[0].weight  # still tied after loading


def test_huggingface_hub_loads_ours_and_we_load_theirs(tmp_path: Path) -> None:
    from huggingface_hub import load_torch_model, save_torch_state_dict

    import faccel

    dist = faccel.detect({})
    spec = example_spec(tied=False)
    model, _, _, _ = build(spec, seed=0)
    faccel.save_model(dist, model, tmp_path / "ours", max_shard_size=200)
    assert len(os.listdir(tmp_path / "ours")) > 2  # sharded
    theirs_model, _, _, _ = build(spec, seed=1)
    load_torch_model(theirs_model, tmp_path / "ours", strict=True)
    _tensors_equal(model, theirs_model)

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    (tmp_path / "theirs").mkdir()
    save_torch_state_dict(state, tmp_path / "theirs", max_shard_size=200)
    target, _, _, _ = build(spec, seed=2)
    faccel.load_model(dist, target, tmp_path / "theirs")
    _tensors_equal(model, target)


def test_tied_weights_are_stored_once_and_come_back_tied(tmp_path: Path) -> None:
    import safetensors.torch

    import faccel

    dist = faccel.detect({})
    model, _, _, _ = build(example_spec(tied=True), seed=0)
    faccel.save_model(dist, model, tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    assert "hidden.0.weight" in stored and "tied.weight" not in stored
    target, _, _, _ = build(example_spec(tied=True), seed=1)
    faccel.load_model(dist, target, tmp_path)
    assert target.tied.weight is target.hidden[0].weight
    assert torch.equal(target.tied.weight, model.hidden[0].weight)
    # A model without the tie needs the name the file lacks: reported as missing.
    untied, _, _, _ = build(example_spec(tied=True), seed=1)
    untied.tied.weight = torch.nn.Parameter(untied.tied.weight.detach().clone())
    with pytest.raises(faccel.errors.CheckpointError, match=r"missing 'tied\.weight'"):
        faccel.load_model(dist, untied, tmp_path)


def test_non_contiguous_parameters_are_saved(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    model, _, _, _ = build(example_spec(transposed=True), seed=0)
    assert not model.proj.is_contiguous()
    faccel.save_model(dist, model, tmp_path)
    target, _, _, _ = build(example_spec(transposed=True), seed=1)
    faccel.load_model(dist, target, tmp_path)
    assert torch.equal(target.proj, model.proj)


def test_every_mismatch_in_one_error_and_nothing_loaded(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    source = torch.nn.ModuleDict(
        {"a": torch.nn.Linear(3, 2), "b": torch.nn.Linear(2, 2), "extra": torch.nn.Linear(1, 1)}
    )
    faccel.save_model(dist, source, tmp_path)
    target = torch.nn.ModuleDict(
        {"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(2, 2).double(), "new": torch.nn.Linear(1, 1)}
    )
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(faccel.errors.CheckpointError) as error:
        faccel.load_model(dist, target, tmp_path)
    message = str(error.value)
    for part in (
        "'a.weight' has shape [2, 3] in the file, [2, 4]",
        "'b.weight' has dtype torch.float32",
        "missing 'new.weight'",
        "unexpected 'extra.bias'",
    ):
        assert part in message
    assert str(tmp_path) in message
    assert_same(dict(target.state_dict()), before)
    # strict=False: missing/unexpected are returned, shapes and dtypes still refused
    relaxed = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 2), "new": torch.nn.Linear(1, 1)})
    missing, unexpected = faccel.load_model(dist, relaxed, tmp_path, strict=False)
    assert missing == ("new.weight", "new.bias")
    assert set(unexpected) == {"b.weight", "b.bias", "extra.weight", "extra.bias"}
    assert torch.equal(relaxed["a"].weight, source["a"].weight)


def test_wrapped_models_save_and_load_their_inner_weights(tmp_path: Path) -> None:
    import faccel

    dist = faccel.DistState.simulated(precision="bf16")
    model = faccel.prepare(dist, Net(example_spec()))
    assert model is not faccel.unwrap_model(model)
    faccel.save_model(dist, model, tmp_path)
    target = faccel.prepare(dist, Net(example_spec()))
    faccel.load_model(dist, target, tmp_path)
    _tensors_equal(faccel.unwrap_model(model), faccel.unwrap_model(target))


def test_only_the_main_process_writes(tmp_path: Path) -> None:
    import faccel

    faccel.save_model(faccel.DistState.simulated(rank=1, world_size=2), torch.nn.Linear(2, 2), tmp_path / "m")
    assert not (tmp_path / "m").exists()


def test_a_resave_with_fewer_shards_removes_the_stale_ones(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    model, _, _, _ = build(example_spec(), seed=0)
    (tmp_path / "config.json").write_text("{}")
    faccel.save_model(dist, model, tmp_path, max_shard_size=100)
    assert len(os.listdir(tmp_path)) > 3
    faccel.save_model(dist, model, tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda d: (d / "model.safetensors.index.json").unlink(), "neither model.safetensors nor"),
        (lambda d: (d / "model.safetensors.index.json").write_text("{"), "not JSON"),
        (
            lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {"w": "../x"}}'),
            "weight_map",
        ),
        (lambda d: _shard(d, 2).unlink(), "missing"),
        (lambda d: _truncate(_shard(d, 3)), "truncated"),
        (lambda d: _remap(d), "disagree"),
    ],
)
def test_broken_sharded_folders_raise_and_load_nothing(tmp_path: Path, edit: Any, match: str) -> None:
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    faccel.save_model(dist, model, tmp_path, max_shard_size=80)
    assert len([f for f in os.listdir(tmp_path) if SHARD.fullmatch(f)]) == 3
    edit(tmp_path)
    target = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(faccel.errors.CheckpointError, match=match):
        faccel.load_model(dist, target, tmp_path)
    assert_same(dict(target.state_dict()), before)


def _shard(folder: Path, k: int) -> Path:
    (path,) = folder.glob(f"model-*-{k:05d}-of-00003.safetensors")
    return path


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-4])


def _remap(folder: Path) -> None:
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["0.weight"] = _shard(folder, 3).name  # shard 1 holds it
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize("bad", ["5XB", "", "-1GB", 0, "1.5.2MB"])
def test_bad_shard_sizes_are_refused(tmp_path: Path, bad: Any) -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentValueError, match="max_shard_size"):
        faccel.save_model(faccel.detect({}), torch.nn.Linear(1, 1), tmp_path, max_shard_size=bad)


def _versioned(version: float) -> torch.nn.Module:
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    with torch.no_grad():
        for tensor in model.parameters():
            tensor.fill_(version)
    return model


def _assert_loads_version(folder: Path, version: float) -> None:
    import faccel

    target = _versioned(-1)
    faccel.load_model(faccel.detect({}), target, folder)
    assert all(bool((t == version).all()) for t in target.state_dict().values())


@pytest.mark.parametrize("fail_after", [0, 2, 5, 8], ids=["shard-1", "shard-2", "shard-3", "index"])
@pytest.mark.parametrize("shard_size", [5000, 10**9], ids=["over-4-shards", "over-1-file"])
def test_a_full_disk_fails_the_save_leaves_the_earlier_one_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_after: int, shard_size: int
) -> None:
    """ENOSPC at the n-th write of a 4-shard save: a StorageError, the folder as the earlier save left it."""
    import errno

    import faccel
    from faccel._storage import _durable

    dist = faccel.detect({})
    faccel.save_model(dist, _versioned(1), tmp_path, max_shard_size=shard_size)
    before = sorted(os.listdir(tmp_path))
    writes = 0
    original = _durable.SyncedWriter.write

    def full(self: _durable.SyncedWriter, chunk: Any) -> None:
        nonlocal writes
        writes += 1
        if writes > fail_after:
            view = memoryview(chunk).cast("B")
            os.write(self.fd, view[: len(view) // 2])  # part of it, as a filling disk does
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, chunk)

    monkeypatch.setattr(_durable.SyncedWriter, "write", full)
    with pytest.raises(faccel.errors.StorageError, match="save_model failed"):
        faccel.save_model(dist, _versioned(2), tmp_path, max_shard_size=5000)
    assert sorted(os.listdir(tmp_path)) == before  # no .tmp-*, no shard of the failed save
    _assert_loads_version(tmp_path, 1)
    monkeypatch.undo()
    faccel.save_model(dist, _versioned(2), tmp_path, max_shard_size=5000)
    _assert_loads_version(tmp_path, 2)


def test_a_really_full_disk_fails_the_save_and_leaves_the_earlier_one(tmp_path: Path) -> None:
    """A 64 KiB tmpfs holds one 4-shard save, not two: the second fails (ENOSPC), the first stays whole.

    Root only (the mount); elsewhere the monkeypatched ENOSPC test above stands in.
    """
    import subprocess

    import faccel

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(disk)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root only): {mounted.stderr.decode().strip()}")
    try:
        dist = faccel.detect({})
        faccel.save_model(dist, _versioned(1), disk, max_shard_size=5000)
        before = sorted(os.listdir(disk))
        with pytest.raises(faccel.errors.StorageError, match="No space left on device"):
            faccel.save_model(dist, _versioned(2), disk, max_shard_size=5000)
        assert sorted(os.listdir(disk)) == before
        _assert_loads_version(disk, 1)
        faccel.save_model(dist, _versioned(3), disk, max_shard_size=10**9)  # one file fits beside them
        assert sorted(os.listdir(disk)) == ["model.safetensors"]
        _assert_loads_version(disk, 3)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
