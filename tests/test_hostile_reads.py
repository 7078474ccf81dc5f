"""Hostile files: every read ends in a CheckpointError, its reads and memory bounded.

Each attack is set up here, then read in a child process that runs under
``RLIMIT_AS`` (what it had mapped after importing faccel, plus 2 GiB), which
counts the bytes each attack's ``read`` calls return (``rchar`` in
``/proc/self/io``: a file read through instead of refused shows there, on a
machine of any speed), with a ``signal.alarm`` per attack and a timeout on
the whole child that only a hang reaches: a read that blocks (a FIFO),
allocates what a file claims (a sparse 20 GB file, a manifest naming 10^12
ranks) or recurses without end fails the test instead of hanging or
swapping the suite. One child runs every attack (importing
torch once); each attack's outcome is checked by its own test.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.manifests import rehash

_CHILD = r"""
import json, os, resource, signal, sys
from pathlib import Path
import torch, faccel

def build():
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)
    return model, faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))

def rchar():
    return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])

def alarm(*_):
    raise TimeoutError("the read did not finish within its alarm")

vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), vm + (2 << 30)))
signal.signal(signal.SIGALRM, alarm)
dist = faccel.detect({})
out = {}
for name, kind, path, strict in json.loads(sys.argv[1]):
    model, state = build()
    before = [p.detach().clone() for p in model.parameters()]
    start = rchar()
    signal.alarm(120)
    try:
        if kind == "restore":
            faccel.restore(dist, state, path)
            result = ("ok", "")
        else:
            result = ("ok", repr(faccel.load_model(dist, model, path, strict=strict)))
    except BaseException as error:
        result = (type(error).__name__, str(error)[:300])
    finally:
        signal.alarm(0)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    out[name] = [*result, rchar() - start, unchanged]
print(json.dumps(out))
"""


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 2)


def _safetensors(header: dict[str, Any], data: bytes = b"") -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def _deep_header() -> bytes:
    text = b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return struct.pack("<Q", len(text)) + text


def _header(path: Path) -> tuple[dict[str, Any], bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + length]), raw[8 + length :]


def _with_evil_tensor(path: Path) -> None:
    """Add a zero-size tensor with a 2^64 dimension: it tiles, and broke tensor views."""
    header, data = _header(path)
    header["evil"] = {"dtype": "F32", "shape": [0, 2**64], "data_offsets": [len(data), len(data)]}
    path.write_bytes(_safetensors(header, data))


def _checkpoint(root: Path) -> Path:
    import attrs

    import faccel

    model = _linear()
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    return faccel.checkpoint(faccel.detect({}), attrs.evolve(state, step=9), root)


def _save(folder: Path, **kwargs: Any) -> Path:
    import faccel

    return faccel.save_model(faccel.detect({}), _linear(), folder, **kwargs)


def _forge_huge_optimizer_state(root: Path, rows: int) -> Path:
    """A sharded checkpoint whose headers, state.json, rank page and manifest all agree on an
    optimizer tensor of ``rows`` x 3 fp32, backed by a sparse file: consistent, forged
    (every rank used to allocate it before the shape check)."""
    import attrs

    import faccel

    model = _linear()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    folder = faccel.checkpoint(faccel.detect({}), attrs.evolve(state, step=9), root, sharded=True)
    key, width = "optimizer/state.0.momentum_buffer", 3 * 4
    content = json.loads((folder / "state.json").read_text())
    content["tensors"]["optimizer"]["state.0.momentum_buffer"].update(shape=[rows, 3], block=rows)
    (folder / "state.json").write_text(json.dumps(content))
    path = folder / "shard-00000.safetensors"
    header, data = _header(path)
    meta = json.loads(header.pop("__metadata__")["faccel"])
    blobs = {k: data[v["data_offsets"][0] : v["data_offsets"][1]] for k, v in header.items()}
    per = (4 << 20) // width
    count = -(-rows // per)
    zeros = hashlib.sha256(bytes(per * width)).hexdigest()
    meta["hash_rows"][key], meta["rows"][key] = per, [0, rows]
    meta["sha256"][key] = [zeros] * (count - 1) + [
        hashlib.sha256(bytes((rows - (count - 1) * per) * width)).hexdigest()
    ]
    forged: dict[str, Any] = {"__metadata__": {"faccel": json.dumps(meta, separators=(",", ":"))}}
    offset = 0
    for name in [k for k in header if k != key] + [key]:  # the huge one last: a sparse tail
        size = rows * width if name == key else len(blobs[name])
        forged[name] = {**header[name], "data_offsets": [offset, offset + size]}
        offset += size
    forged[key]["shape"] = [rows, 3]
    head = _safetensors(forged)
    path.write_bytes(head + b"".join(blobs[k] for k in header if k != key))
    os.truncate(path, len(head) + offset)
    page = json.loads((folder / "ranks-00000.json").read_text())
    page["ranks"][0]["shard"] = {"size": len(head) + offset, "sha256": hashlib.sha256(head).hexdigest()}
    (folder / "ranks-00000.json").write_text(json.dumps(page))
    rehash(folder, "ranks-00000.json")
    rehash(folder, "state.json")
    return folder


def _attacks(tmp: Path) -> list[tuple[str, str, str, bool]]:
    """Set up every attack under ``tmp``: (name, restore or load_model, path, strict)."""
    attacks: list[tuple[str, str, str, bool]] = []

    def restore_case(name: str) -> Path:
        folder = _checkpoint(tmp / name)
        attacks.append((name, "restore", str(folder.parent), True))
        return folder

    def load_case(name: str, strict: bool = True, **kwargs: Any) -> Path:
        folder = _save(tmp / name, **kwargs)
        attacks.append((name, "load_model", str(folder), strict))
        return folder

    folder = restore_case("manifest world_size 10**12")
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "world_size": 10**12}))
    folder = restore_case("sparse 20 GB manifest")
    os.truncate(folder / "manifest.json", 20 << 30)
    folder = restore_case("sparse 20 GB model file in a checkpoint")
    os.truncate(folder / "model.safetensors", 20 << 30)
    # the manifest's size edited to match, so the size check alone passes
    folder = restore_case("sparse 20 GB model file with the manifest's size to match")
    os.truncate(folder / "model.safetensors", 20 << 30)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["model.safetensors"]["size"] = 20 << 30
    (folder / "manifest.json").write_text(json.dumps(manifest))
    folder = restore_case("FIFO manifest.json")
    (folder / "manifest.json").unlink()
    os.mkfifo(folder / "manifest.json")
    folder = restore_case("FIFO model.safetensors in a checkpoint")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    folder = restore_case("model.safetensors a directory in a checkpoint")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()
    folder = restore_case("symlink to an outside model.safetensors")
    outside = _checkpoint(tmp / "outside-model")  # the same bytes: it would load if followed
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    outside = _checkpoint(tmp / "outside-step")
    (tmp / "linked-root").mkdir()
    (tmp / "linked-root" / outside.name).symlink_to(outside)
    attacks.append(("symlink to an outside step-* folder", "restore", str(tmp / "linked-root"), True))
    folder = restore_case("100,000-deep state.json")
    (folder / "state.json").write_text("[" * 100_000 + "]" * 100_000)
    rehash(folder, "state.json")
    folder = restore_case("5,000-digit number in state.json")
    state = json.loads((folder / "state.json").read_text())
    (folder / "state.json").write_text(json.dumps(state).replace('"step": 9', '"step": ' + "9" * 5000))
    rehash(folder, "state.json")
    folder = restore_case("100,000-deep safetensors header in a checkpoint")
    (folder / "model.safetensors").write_bytes(_deep_header())
    rehash(folder, "model.safetensors")
    folder = restore_case("zero-size tensor with a 2^64 dimension in a checkpoint")
    _with_evil_tensor(folder / "model.safetensors")
    rehash(folder, "model.safetensors")

    folder = _forge_huge_optimizer_state(tmp / "v2 forged 6 GiB optimizer state", 1 << 29)
    attacks.append(("v2: a consistent forged 6 GiB optimizer state", "restore", str(folder), True))

    folder = load_case("load_model: FIFO model.safetensors")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    folder = load_case("load_model: symlink to an outside model.safetensors")
    outside = _save(tmp / "outside-weights")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").symlink_to(outside / "model.safetensors")
    folder = load_case("load_model: a shard that is a directory", max_shard_size=24)
    (shard,) = folder.glob("model-*-00002-of-00002.safetensors")  # save_model tags each save's shards
    shard.unlink()
    shard.mkdir()
    folder = load_case("load_model(strict=False): shard 2 has a 2^64 dimension", False, max_shard_size=24)
    (shard,) = folder.glob("model-*-00002-of-00002.safetensors")
    _with_evil_tensor(shard)
    folder = load_case("load_model: 100,000-deep header")
    (folder / "model.safetensors").write_bytes(_deep_header())
    folder = load_case("load_model: 5,000-digit number in the index", max_shard_size=24)
    index = (folder / "model.safetensors.index.json").read_text()
    (folder / "model.safetensors.index.json").write_text(
        index.replace('"total_size": 32', '"total_size": ' + "9" * 5000)
    )
    folder = load_case("load_model: FIFO pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "pytorch_model.bin")
    # Not an error: a sparse 20 GB tensor the model does not take is never read (strict=False).
    folder = load_case("load_model(strict=False): sparse 20 GB unexpected tensor", False)
    header, data = _header(folder / "model.safetensors")
    header["huge"] = {"dtype": "U8", "shape": [20 << 30], "data_offsets": [len(data), len(data) + (20 << 30)]}
    (folder / "model.safetensors").write_bytes(_safetensors(header, data))
    os.truncate(folder / "model.safetensors", (folder / "model.safetensors").stat().st_size + (20 << 30))
    return attacks


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Any]]:
    attacks = _attacks(tmp_path_factory.mktemp("hostile"))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(attacks)],
        capture_output=True,
        text=True,
        timeout=1200,  # a hang guard: each attack's alarm fires long before
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, list[Any]] = json.loads(done.stdout.splitlines()[-1])
    assert set(result) == {name for name, *_ in attacks}
    return result


REFUSED = {
    "manifest world_size 10**12": "world_size",
    "sparse 20 GB manifest": "no checkpoint there",
    "sparse 20 GB model file in a checkpoint": "model.safetensors: the file has 21474836480 bytes",
    "sparse 20 GB model file with the manifest's size to match": "21474836480 bytes, more than the",
    "FIFO manifest.json": "no checkpoint there",
    "FIFO model.safetensors in a checkpoint": "model.safetensors: a FIFO, not a regular file",
    "model.safetensors a directory in a checkpoint": "model.safetensors: a folder, not a regular file",
    "symlink to an outside model.safetensors": "model.safetensors: it or its folder is a symbolic link",
    "symlink to an outside step-* folder": "no checkpoint there",
    "100,000-deep state.json": "state.json: not JSON (RecursionError",
    "5,000-digit number in state.json": "state.json: not JSON (ValueError",
    "100,000-deep safetensors header in a checkpoint": "model.safetensors: not a valid safetensors file",
    "zero-size tensor with a 2^64 dimension in a checkpoint": "malformed or oversized shape",
    "v2: a consistent forged 6 GiB optimizer state": (
        "'momentum_buffer' of parameter 0 is torch.float32 [536870912, 3], the parameter is"
    ),
    "load_model: FIFO model.safetensors": "model.safetensors: a FIFO, not a regular file",
    "load_model: symlink to an outside model.safetensors": "a symbolic link to",
    "load_model: a shard that is a directory": "-00002-of-00002.safetensors: a folder",
    "load_model(strict=False): shard 2 has a 2^64 dimension": "malformed or oversized shape",
    "load_model: 100,000-deep header": "the header is not JSON (RecursionError",
    "load_model: 5,000-digit number in the index": "not JSON (ValueError",
    "load_model: FIFO pytorch_model.bin": "pytorch_model.bin: a FIFO, not a regular file",
}


# What an attack may read: its small real files and the modules imported on the way (a file that
# is read through instead of refused reads gigabytes).
_READ_BOUND = 64 << 20


@pytest.mark.parametrize("name", list(REFUSED))
def test_hostile_files_are_refused_with_a_checkpoint_error_reading_little_and_touching_nothing(
    outcomes: dict[str, list[Any]], name: str
) -> None:
    kind, message, read, unchanged = outcomes[name]
    assert kind == "CheckpointError", (kind, message)
    assert REFUSED[name] in message, message
    assert read < _READ_BOUND, read
    assert unchanged, "the model was modified"


def test_a_sparse_tensor_the_model_does_not_take_is_never_read(outcomes: dict[str, list[Any]]) -> None:
    kind, message, read, _ = outcomes["load_model(strict=False): sparse 20 GB unexpected tensor"]
    assert (kind, message) == ("ok", "((), ('huge',))")
    assert read < _READ_BOUND, read


def test_load_model_follows_links_inside_its_folder_and_into_a_hugging_face_cache(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    inside = _save(tmp_path / "inside")
    (inside / "real").mkdir()
    (inside / "model.safetensors").rename(inside / "real" / "weights")
    (inside / "model.safetensors").symlink_to("real/weights")
    assert faccel.load_model(dist, torch.nn.Linear(3, 2), inside) == ((), ())
    # huggingface_hub's cache: snapshots/<revision>/<file> -> ../../blobs/<hash>
    repo = tmp_path / "models--me--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (_save(tmp_path / "saved") / "model.safetensors").rename(repo / "blobs" / "f00d")
    (snapshot / "model.safetensors").symlink_to("../../blobs/f00d")
    model = torch.nn.Linear(3, 2)
    assert faccel.load_model(dist, model, snapshot) == ((), ())
    assert torch.equal(model.weight, _linear().weight)


def test_a_symlinked_checkpoint_folder_inside_the_root_is_not_followed(tmp_path: Path) -> None:
    import faccel

    folder = _checkpoint(tmp_path / "root")
    folder.rename(tmp_path / "root" / "real")
    folder.symlink_to("real")  # inside the root, but a checkpoint folder is never a link
    assert faccel.latest_checkpoint(tmp_path / "root") is None
