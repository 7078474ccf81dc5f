"""Hostile names and sizes in files faccel reads get a named CheckpointError.

Before: a weight_map naming a shard with a NUL byte raised ``ValueError: embedded null byte`` from
``load_model`` and ``convert``; a whole-tensor checkpoint whose manifest claims a 20 GiB (sparse)
file reached ``torch.empty(size)`` and the allocator's raw ``RuntimeError`` under a memory limit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import faccel
from faccel.errors import CheckpointError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("index_name", ["model.safetensors.index.json", "pytorch_model.bin.index.json"])
@pytest.mark.parametrize("shard", ["model\x00.safetensors", "a\x00/../../etc/passwd", "\x00"])
def test_a_shard_name_with_a_nul_byte_is_named_by_load_model_and_convert(
    tmp_path: Path, index_name: str, shard: str
) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / index_name).write_text(json.dumps({"metadata": {}, "weight_map": {"weight": shard}}))
    model = torch.nn.Linear(2, 1, bias=False)
    before = model.weight.detach().clone()
    with pytest.raises(CheckpointError, match="weight_map"):
        faccel.load_model(faccel.detect({}), model, folder)
    assert torch.equal(model.weight, before)  # nothing touched
    from faccel._hf._save_model import convert_weights

    with pytest.raises(CheckpointError, match="weight_map"):
        convert_weights(folder, tmp_path / "out")
    assert not (tmp_path / "out").exists()


_SPARSE = textwrap.dedent(
    """
    import json, os, resource, sys
    from pathlib import Path
    import attrs, torch, faccel

    folder = Path(sys.argv[1])
    dist = faccel.detect({})
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = faccel.TrainState(model=model, optimizer=optimizer, step=1, extras={"seen": torch.zeros(3)})
    ckpt = faccel.checkpoint(dist, state, folder)
    manifest_path = ckpt / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    claimed = 20 << 30
    os.truncate(ckpt / "extras.safetensors", claimed)  # a sparse 20 GiB file: nothing on disk
    manifest["files"]["extras.safetensors"]["size"] = claimed
    manifest_path.write_text(json.dumps(manifest))
    before = model.weight.detach().clone()
    # The process may take 1 GiB more than it has mapped: less than the file claims.
    mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
    try:
        faccel.restore(dist, state, ckpt)
    except Exception as error:
        print(json.dumps([type(error).__name__, isinstance(error, faccel.errors.CheckpointError), str(error),
                          torch.equal(model.weight, before)]))
    else:
        print(json.dumps(["no error", False, "", False]))
    """
)


def test_a_whole_tensor_file_claiming_more_than_the_process_can_allocate_is_named(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SPARSE, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=600,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    kind, named, message, untouched = json.loads(done.stdout.splitlines()[-1])
    assert named, (kind, message)
    assert "21474836480 bytes" in message and "more than" in message, message
    assert untouched
