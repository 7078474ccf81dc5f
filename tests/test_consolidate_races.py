"""``consolidate`` reads one save, never a mix, whatever replaces the checkpoint."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

import faccel
from faccel._checkpoint._weights_reader import open_weights as _specs_and_reader
from faccel.errors import CheckpointError
from tests.manifests import rehash


def _state(fill: float) -> faccel.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(fill)
    return faccel.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=5)


@pytest.mark.parametrize("sharded", [False, True], ids=["v1", "v2-sharded"])
def test_a_replace_between_the_check_and_the_reads_does_not_mix_in(tmp_path: Path, sharded: bool) -> None:
    dist = faccel.detect({})
    folder = faccel.checkpoint(dist, _state(1.0), tmp_path, sharded=sharded)
    specs, read, close = _specs_and_reader(folder)  # checked: the save of 1.0s
    try:
        # a replace=True save of the same step, renamed into place while consolidate reads
        assert faccel.checkpoint(dist, _state(2.0), tmp_path, keep=1, replace=True, sharded=sharded) == folder
        try:
            values = {float(read(name).unique().item()) for name in specs}
        except CheckpointError as error:  # the sharded reader meets the new save's rank page: refused
            assert sharded and "checksum differs" in str(error), error
            return
    finally:
        close()
    assert values == {1.0}, values  # before: the v1 path reopened the file by path and read the 2.0s


def test_a_version_1_checkpoint_consolidates_to_its_weights(tmp_path: Path) -> None:
    from faccel._hf._consolidate import consolidate

    dist = faccel.detect({})
    folder = faccel.checkpoint(dist, _state(3.0), tmp_path / "ckpt", sharded=False)
    consolidate(folder, tmp_path / "hf")
    target = _state(0.0).model
    faccel.load_model(dist, target, tmp_path / "hf")
    assert all(bool((p == 3.0).all()) for p in target.parameters())


# --- a failed consolidate cleans up; every error is named ---------------------------


def _big_checkpoint(root: Path) -> Path:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))  # ~33 KB of weights
    state = faccel.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=1)
    return faccel.checkpoint(faccel.detect({}), state, root, sharded=False)


def test_a_leftover_temporary_of_a_failed_run_does_not_refuse_the_rerun(tmp_path: Path) -> None:
    from faccel._hf._consolidate import consolidate

    folder = _big_checkpoint(tmp_path / "ckpt")
    (out := tmp_path / "hf").mkdir()
    (out / ".tmp-model.safetensors").write_bytes(b"half a file")  # what a killed run leaves
    consolidate(folder, out)
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


def test_a_folder_in_the_temporary_s_place_is_a_storage_error(tmp_path: Path) -> None:
    from faccel._hf._consolidate import consolidate
    from faccel.errors import StorageError

    folder = _big_checkpoint(tmp_path / "ckpt")
    (tmp_path / "hf" / ".tmp-model.safetensors").mkdir(parents=True)
    with pytest.raises(StorageError, match=r"\.tmp-model\.safetensors is a folder"):
        consolidate(folder, tmp_path / "hf")
    assert (tmp_path / "hf" / ".tmp-model.safetensors").is_dir()  # not ours: left alone


@contextlib.contextmanager
def _tiny_disk(disk: Path) -> Iterator[Path]:
    """A real 16 KiB tmpfs at ``disk`` for the ``with`` block (root only: skipped elsewhere)."""
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(disk)], capture_output=True, check=False
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (root only): {mounted.stderr.decode().strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_full_disk_is_a_storage_error_and_leaves_nothing(tmp_path: Path) -> None:
    """A 16 KiB tmpfs cannot hold the 33 KB model. Root only (the mount)."""

    from faccel._hf._consolidate import consolidate
    from faccel.errors import StorageError

    folder = _big_checkpoint(tmp_path / "ckpt")
    with _tiny_disk(tmp_path / "disk") as disk:
        with pytest.raises(StorageError, match=r"No space left on device.*free space"):
            consolidate(folder, disk, max_shard_size=20_000)
        assert os.listdir(disk) == []  # the shard written before the failure and the temporary: gone


def test_weights_backed_by_holes_are_refused_unless_allowed(tmp_path: Path) -> None:
    # a forged checkpoint of 144 KB on disk consolidated into a 2 GiB file. Here a
    # consistent one (manifest rehashed) claims a 128 MiB tensor that a sparse file's holes "hold".
    import json
    import struct

    from faccel._hf._consolidate import consolidate

    folder = faccel.checkpoint(faccel.detect({}), _state(1.0), tmp_path / "ckpt")
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    length = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    claim = 32 << 20  # float32 elements: 128 MiB
    header["huge"] = {"dtype": "F32", "shape": [claim], "data_offsets": [len(data), len(data) + 4 * claim]}
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    os.truncate(path, path.stat().st_size + 4 * claim)
    rehash(folder, "model.safetensors")
    assert sum(p.stat().st_blocks * 512 for p in folder.iterdir()) < 1 << 20  # under 1 MiB on disk
    with pytest.raises(CheckpointError, match=r"weights claim \d+ bytes, but its files occupy \d+ bytes"):
        consolidate(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    out = consolidate(folder, tmp_path / "out", allow_sparse=True)  # asked for: written
    assert (out / "model.safetensors").stat().st_size > 4 * claim


def test_convert_on_a_full_disk_is_a_storage_error_and_leaves_nothing(tmp_path: Path) -> None:
    """For ``convert``: a 16 KiB tmpfs cannot hold the 33 KB of weights. Root only."""

    from faccel._hf._save_model import convert_weights
    from faccel.errors import StorageError

    torch.manual_seed(0)
    torch.save(nn.Linear(64, 128).state_dict(), tmp_path / "pytorch_model.bin")  # 33 KB of tensors
    with _tiny_disk(tmp_path / "disk") as disk:
        with pytest.raises(StorageError, match=r"No space left on device"):
            convert_weights(tmp_path, disk / "out")
        assert not [p for p in disk.rglob("*") if p.is_file()]  # no temporary or partial file left
