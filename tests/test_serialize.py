"""Tagged JSON, the safetensors reader/writer and durable files: the layers under checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.distributed.checkpoint_workers import assert_same
from tests.manifests import digest
from tests.strategies import plain_trees

DTYPES = [
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Small tensors of every dtype: 0-d, empty and non-contiguous ones included."""
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(min_value=0, max_value=4), max_size=3)))
    seed = draw(st.integers(min_value=0, max_value=2**16))
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        tensor = torch.randn(shape, generator=g).to(dtype)
    elif dtype is torch.bool:
        tensor = torch.randint(0, 2, shape, generator=g).bool()
    else:
        tensor = torch.randint(0, 100, shape, generator=g).to(dtype)
    if draw(st.booleans()) and tensor.dim() >= 2:
        tensor = tensor.transpose(0, 1)  # non-contiguous
    return tensor


def _arrays() -> st.SearchStrategy[Any]:
    return st.builds(
        lambda dtype, n, scalar: (
            (np.arange(n) % 3).astype(dtype)[0] if scalar and n else (np.arange(n) % 3).astype(dtype)
        ),
        st.sampled_from(["<u4", "<i8", "<f8", "<f4", "|b1", "<c16"]),
        st.integers(min_value=0, max_value=5),
        st.booleans(),
    )


trees = st.recursive(
    plain_trees | tensors() | _arrays(),
    lambda inner: (
        st.lists(inner, max_size=3) | st.tuples(inner, inner) | st.dictionaries(st.text(max_size=4), inner)
    ),
    max_leaves=10,
)


@given(value=trees, inline=st.booleans())
def test_tagged_json_round_trips_every_value_exactly(value: Any, inline: bool) -> None:
    from faccel._storage._tagged_json import TensorSink, decode, encode

    sink = None if inline else TensorSink(file="t.safetensors")
    text = json.dumps(encode(value, sink=sink), allow_nan=False)  # strict JSON: no NaN literals
    files = {} if sink is None else {"t.safetensors": sink.tensors}
    assert_same(decode(json.loads(text), tensors=files, where="x.json"), value)


def test_tags_read_like_json_and_tag_like_keys_survive() -> None:
    from faccel._storage._tagged_json import decode, encode

    value = {"__tuple__": 1, "betas": (0.9, 0.999), 0: [float("-inf")]}
    encoded = encode(value)
    assert encoded == {
        "__dict__": [
            ["__tuple__", 1],
            ["betas", {"__tuple__": [0.9, 0.999]}],
            [0, [{"__float__": "-inf"}]],
        ]
    }
    assert decode(encode({"__tuple__": 1}), tensors={}, where="x") == {"__tuple__": 1}
    assert encode({"a": 1, "__tuple__": 2}) == {"a": 1, "__tuple__": 2}  # two keys: never a tag


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"f": len}, "f"),
        ([1, {2, 3}], "1"),
        ({"x": object()}, "x"),
        ({"a": np.array(["s"], dtype=object)}, "a"),
        ((1, 2.5j), "1"),
    ],
)
def test_values_without_a_pickle_free_form_are_refused_by_path(value: Any, path: str) -> None:
    from faccel._storage._tagged_json import encode
    from faccel.errors import CheckpointError

    with pytest.raises(CheckpointError, match=path):
        encode(value)


@pytest.mark.parametrize(
    "tree",
    [
        {"__tuple__": 3},
        {"__float__": "NaN"},
        {"__float__": "nan:zz"},
        {"__bytes__": "not base64!"},
        {"__dict__": [[1]]},
        {"__dict__": [[[1], 2]]},
        {"__tensor__": ["other.safetensors", "k"]},
        {"__inline_tensor__": {"dtype": "F32", "shape": [2], "data": ""}},
        {"__inline_tensor__": {"dtype": "PICKLE", "shape": [], "data": ""}},
        {"__ndarray__": {"dtype": "O", "shape": [1], "data": ""}},
        {"__ndarray__": {"dtype": "<f8", "shape": [-1], "data": ""}},
    ],
)
def test_malformed_tags_raise_checkpoint_error_naming_the_file(tree: Any) -> None:
    from faccel._storage._tagged_json import decode
    from faccel.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"state\.json"):
        decode(tree, tensors={}, where="state.json")


@given(named=st.dictionaries(st.from_regex(r"[a-z.]{1,6}", fullmatch=True), tensors(), max_size=5))
def test_safetensors_written_here_load_with_the_library_and_back(named: dict[str, torch.Tensor]) -> None:
    import tempfile

    import safetensors.torch

    from faccel._storage._durable import read_verified, write_durably
    from faccel._storage._safetensors import parse_header, plan, tensor_views

    with tempfile.TemporaryDirectory() as folder:
        ours = Path(folder) / "ours.safetensors"
        record = write_durably(ours, plan(named, metadata={"format": "pt"}))
        assert record.size == ours.stat().st_size
        with safetensors.safe_open(ours, framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
        loaded = safetensors.torch.load_file(ours)
        assert_same(dict(loaded), {k: v.contiguous() for k, v in named.items()})

        theirs = Path(folder) / "theirs.safetensors"
        safetensors.torch.save_file({k: v.contiguous() for k, v in named.items()}, theirs)
        buffer, record = read_verified(theirs, None, where="theirs")
        header = parse_header(buffer.numpy().data, record.size, where="theirs")
        assert_same(tensor_views(buffer, header), {k: v.contiguous() for k, v in named.items()})


def _write(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "f.safetensors"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda b: b[:-1], "truncated"),
        (lambda b: b[:5], "shorter than"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], "does not fit"),
        (lambda b: b[:8] + b"[" + b[9:], "not JSON"),
        (lambda b: b.replace(b'"F32"', b'"X32"'), "unknown tensor dtype"),
        (lambda b: b.replace(b"[0,16]", b"[4,20]"), "starts at byte 4"),
        (lambda b: b.replace(b'"shape":[4]', b'"shape":[5]'), "do not match shape"),
    ],
)
def test_malformed_safetensors_headers_are_refused(tmp_path: Path, edit: Any, match: str) -> None:
    from faccel._storage._safetensors import plan, read_header
    from faccel.errors import CheckpointError

    good = b"".join(bytes(memoryview(c).cast("B")) for c in plan({"w": torch.ones(4)}))
    path = _write(tmp_path, edit(good))
    with pytest.raises(CheckpointError, match=match) as error:
        read_header(path, where=str(path))
    assert "f.safetensors" in str(error.value)


def test_read_verified_checks_size_and_hash(tmp_path: Path) -> None:
    from faccel._storage._durable import read_verified, write_durably
    from faccel.errors import CheckpointError

    path = tmp_path / "data.bin"
    data = os.urandom(3 << 20)
    for algorithm in ("blake3", "sha256"):  # threaded hashing above 1 MiB
        record = write_durably(path, [data], algorithm=algorithm)
        assert record.digest == digest(algorithm, data) and record.algorithm == algorithm
        buffer, again = read_verified(path, record, where="data.bin")
        assert again == record and buffer.numpy().tobytes() == data
        with pytest.raises(CheckpointError, match="manifest says"):
            read_verified(path, attrs.evolve(record, size=record.size + 1), where="data.bin")
        with pytest.raises(CheckpointError, match=f"the {algorithm} checksum differs"):
            read_verified(path, attrs.evolve(record, digest="0" * 64), where="data.bin")
        with pytest.raises(CheckpointError, match="checksum differs"):  # a digest under the other hash
            other = "sha256" if algorithm == "blake3" else "blake3"
            read_verified(path, attrs.evolve(record, algorithm=other), where="data.bin")
        path.unlink()
    with pytest.raises(CheckpointError, match="missing"):
        read_verified(tmp_path / "nope", None, where="nope")


def test_atomic_write_replaces_whole_files(tmp_path: Path) -> None:
    from faccel._storage._durable import atomic_write

    path = tmp_path / "x.json"
    atomic_write(path, [b"old"])
    atomic_write(path, [b"new", b"er"])
    assert path.read_bytes() == b"newer"
    assert sorted(os.listdir(tmp_path)) == ["x.json"]
