"""SyncedWriter: exact bytes across early-sync boundaries, errors of the early syncs surfaced, and
durable pages dropped from the page cache (the shard and whole-file writers go through it)."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import mmap
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from faccel._checkpoint._sharded._chunks import assign, overlaps
from faccel._checkpoint._sharded._shard_file import ShardFile, byte_view, empty_rows, write_shard
from faccel._storage import _durable
from faccel._storage._durable import SyncedWriter, write_durably
from tests.strategies import byte_chunks


@settings(max_examples=60, deadline=None)
@given(chunks=byte_chunks, every=st.integers(1, 64))
def test_the_file_holds_the_chunks_exactly_wherever_the_early_syncs_fall(
    tmp_path_factory: pytest.TempPathFactory, chunks: list[bytes], every: int
) -> None:
    path = tmp_path_factory.mktemp("synced") / "file"
    saved = _durable._SYNC_BYTES
    _durable._SYNC_BYTES = every  # a sync (and a drop) after every `every` bytes
    try:
        with SyncedWriter(path) as out:
            for chunk in chunks:
                out.write(chunk)
            size = out.close()
    finally:
        _durable._SYNC_BYTES = saved
    assert path.read_bytes() == b"".join(chunks)
    assert size == sum(len(chunk) for chunk in chunks)


def test_an_early_sync_that_fails_fails_the_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken_disk(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_durable, "_SYNC_BYTES", 16)
    monkeypatch.setattr(os, "fdatasync", broken_disk)
    with SyncedWriter(tmp_path / "file") as out:
        out.write(b"x" * 100)
        with pytest.raises(OSError, match="Input/output error"):
            out.close()


def test_a_writer_left_by_an_error_closes_its_descriptor(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), SyncedWriter(tmp_path / "file") as out:
        out.write(b"abc")
        fd = out.fd
        raise RuntimeError
    with pytest.raises(OSError):
        os.fstat(fd)


def _resident_fraction(path: Path) -> float:
    """The fraction of ``path``'s pages in the page cache: mincore(2) over a private mapping."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    vector = (ctypes.c_ubyte * pages)()
    with open(path, "rb") as handle:
        mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_COPY)  # untouched: the cache's pages
        anchor = ctypes.c_char.from_buffer(mapped)
        failed = libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vector)
        del anchor
        mapped.close()
    if failed:
        pytest.skip(f"mincore failed: {os.strerror(ctypes.get_errno())}")
    return sum(byte & 1 for byte in vector) / pages


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise here (macOS)")
def test_a_large_file_leaves_the_page_cache_once_durable_and_a_small_one_stays(tmp_path: Path) -> None:
    payload = os.urandom(_durable._SYNC_BYTES + (3 << 20))
    control = tmp_path / "control"
    with open(control, "wb") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
    if _resident_fraction(control) < 0.9:
        pytest.skip("this file system does not keep written pages cached, so dropping them shows nothing")
    big = tmp_path / "big"
    record = write_durably(big, [payload], algorithm="sha256")
    assert record.digest == hashlib.sha256(payload).hexdigest()
    assert _resident_fraction(big) < 0.1
    small = tmp_path / "small"
    write_durably(small, [payload[: 1 << 20]])
    assert _resident_fraction(small) > 0.9


def test_a_shard_file_written_across_sync_boundaries_reads_back_and_checks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_durable, "_SYNC_BYTES", 4096 + 17)  # odd: syncs fall inside hash blocks
    tensor = torch.randn(3000, 37)
    placed = assign({"model/w": (tensor.dtype, tuple(tensor.shape))}, [], 1)["model/w"]
    path = tmp_path / "shard-0.safetensors"
    record = write_shard(path, {"model/w": tensor}, {"model/w": placed}, rank=0, world=1, step=0)
    (chunk,) = overlaps(placed, 1, 0, 3000)
    shard = ShardFile(path, record, where=str(path))
    try:
        out = empty_rows(placed, 0, 3000)
        shard.read("model/w", placed, chunk, byte_view(out))
    finally:
        shard.close()
    assert torch.equal(out, tensor)
