"""The sharded format's pure parts: the chunk rule, shard files read in part, and metadata that
stays small at 100,000 ranks."""

from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from faccel._checkpoint._folders import latest_checkpoint
from faccel._checkpoint._format import (
    MAX_SHARDED_WORLD,
    PAGE_RANKS,
    checkpoint_name,
    expected_files,
    file_records,
)
from faccel._checkpoint._jobs import manifest_content, write_pages
from faccel._checkpoint._sharded._chunks import Placed, assign, chunks, hash_rows, overlaps, rows_of
from faccel._checkpoint._sharded._flow import Pages
from faccel._checkpoint._sharded._shard_file import ShardFile, byte_view, empty_rows, write_shard
from faccel._storage._durable import FileRecord, write_durably
from faccel.errors import CheckpointError

_SHAPES = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 3)).map(lambda rc: rc if rc[1] > 1 else rc[:1]),
    min_size=1,
    max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(shapes=_SHAPES, world=st.integers(1, 9), data=st.data())
def test_every_row_is_in_exactly_one_chunk_and_overlaps_cover_any_range(
    shapes: list[tuple[int, ...]], world: int, data: st.DataObject
) -> None:
    specs = {f"t{i}": (torch.float32, shape) for i, shape in enumerate(shapes)}
    sharded = data.draw(st.sets(st.sampled_from(sorted(specs))))
    placed = assign(specs, sharded, world)
    for key, spot in placed.items():
        rows = rows_of(spot.shape)
        found = chunks(spot, world)
        assert len(found) <= world and all(0 <= c.rank < world for c in found)
        assert [r for c in found for r in range(c.start, c.stop)] == list(range(rows))
        if key in sharded:  # as torch.chunk (and so DTensor Shard(0)) splits it
            assert (spot.block, spot.first) == (max(1, math.ceil(rows / world)), 0)
        start = data.draw(st.integers(0, rows))
        stop = data.draw(st.integers(start, rows))
        used = [r for c in overlaps(spot, world, start, stop) for r in range(c.use_start, c.use_stop)]
        assert used == list(range(start, stop))


def test_replicated_tensors_are_balanced_by_bytes() -> None:
    specs = {f"w{i}": (torch.float32, (100 + i, 10)) for i in range(12)} | {"s": (torch.float32, ())}
    placed = assign(specs, [], 4)
    loads = [0] * 4
    for spot in placed.values():
        for c in chunks(spot, 4):
            loads[c.rank] += (c.stop - c.start) * 10 * 4
    assert max(loads) / min(loads) < 1.2


def _shard(tmp_path: Path, rows: int, cols: int) -> tuple[Path, FileRecord, Placed, torch.Tensor]:
    tensor = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    placed = Placed(dtype=torch.float32, shape=(rows, cols), block=rows, first=0)
    path = tmp_path / "shard-00000.safetensors"
    return (
        path,
        write_shard(path, {"model/w": tensor}, {"model/w": placed}, rank=0, world=1, step=0),
        placed,
        tensor,
    )


def test_a_partial_read_checks_only_the_hash_blocks_it_touches(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    path, record, placed, tensor = _shard(tmp_path, 3000, 1024)  # 12 MB: three 4 MiB hash blocks
    per = hash_rows(placed)
    assert per == 1024 and torch.equal(load_file(path)["model/w"], tensor)  # standard safetensors
    shard = ShardFile(path, record, where=str(path))
    try:
        (chunk,) = overlaps(placed, 1, 1000, 1100)  # across the first block boundary
        out = empty_rows(placed, 1000, 1100)
        shard.read("model/w", placed, chunk, byte_view(out))
        assert torch.equal(out, tensor[1000:1100])
    finally:
        shard.close()
    # A flipped byte in the last block: a read of rows 0..100 never sees it; one of the last rows does.
    data_start = path.stat().st_size - tensor.numel() * 4
    with open(path, "r+b") as handle:
        handle.seek(data_start + 2900 * 1024 * 4)
        handle.write(b"\xff")
    shard = ShardFile(path, record, where=str(path))
    try:
        (chunk,) = overlaps(placed, 1, 0, 100)
        shard.read("model/w", placed, chunk, byte_view(empty_rows(placed, 0, 100)))
        (chunk,) = overlaps(placed, 1, 2999, 3000)
        with pytest.raises(CheckpointError, match=r"rows 2048:3000: the sha256 checksum differs"):
            shard.read("model/w", placed, chunk, byte_view(empty_rows(placed, 2999, 3000)))
    finally:
        shard.close()


def test_an_altered_header_is_refused_by_its_record(tmp_path: Path) -> None:
    path, record, _, _ = _shard(tmp_path, 4, 2)
    raw = bytearray(path.read_bytes())
    raw[raw.index(b'"shape":[4,2]') + 9] = ord("3")
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="header's sha256 checksum differs"):
        ShardFile(path, record, where=str(path))


def test_a_100000_rank_manifest_stays_small_and_is_found(tmp_path: Path) -> None:
    world = 100_000
    folder = tmp_path / checkpoint_name(5)
    folder.mkdir()
    ranks = [
        (
            FileRecord(size=10**9 + r, digest=f"{r:064x}", algorithm="sha256"),
            FileRecord(size=5000, digest=f"{r + 1:064x}", algorithm="sha256"),
        )
        for r in range(world)
    ]
    record = write_durably(folder / "state.json", [b"{}"], algorithm="sha256")
    listed = {"state.json": record, "extras.safetensors": record} | write_pages(folder, ranks)
    manifest = manifest_content({"step": 5, "epoch": 1, "position": 0}, world, listed, 2)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    # What every rank reads at start: the manifest, about 100 bytes per 1,024 ranks, far under 1 MiB.
    assert (folder / "manifest.json").stat().st_size < 16 * 1024
    assert len(manifest["files"]) == 2 + math.ceil(world / PAGE_RANKS)
    assert latest_checkpoint(tmp_path) == folder
    # A rank's own records: one page of 1,024 ranks read, checked against the manifest.
    pages = Pages(folder, file_records(manifest["files"], 2, where="manifest"), world)
    assert pages.of(99_999) == ranks[99_999] and list(pages.pages) == [99_999 // PAGE_RANKS]
    assert max(p.stat().st_size for p in folder.glob("ranks-*.json")) < 256 * 1024


def _refusing_direct_reads(shard: ShardFile) -> Any:
    """os.preadv as a file system without O_DIRECT answers on the shard's direct descriptor."""
    real = os.preadv

    def preadv(fd: int, buffers: Any, offset: int) -> int:
        if fd == shard.file.direct_fd:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real(fd, buffers, offset)

    return preadv


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 3000),
    cols=st.integers(1, 700),
    dtype=st.sampled_from([torch.float32, torch.int8, torch.float64, torch.bfloat16]),
    cut=st.tuples(st.floats(0, 1), st.floats(0, 1)),
    mode=st.sampled_from(["around the cache", "through the cache", "around refused"]),
)
def test_any_rows_read_back_exactly_around_the_page_cache_or_through_it(
    tmp_path_factory: pytest.TempPathFactory,
    rows: int,
    cols: int,
    dtype: torch.dtype,
    cut: tuple[float, float],
    mode: str,
) -> None:
    """Reads skip the page cache (O_DIRECT, aligned scratch) where the file system allows, else go
    through it; a refusal mid-file switches over. Every mode gives the same rows, hash-checked."""
    tensor = torch.randint(-100, 100, (rows, cols)).to(dtype)
    placed = Placed(dtype=dtype, shape=(rows, cols), block=rows, first=0)
    path = tmp_path_factory.mktemp("direct") / "shard-00000.safetensors"
    record = write_shard(path, {"model/w": tensor}, {"model/w": placed}, rank=0, world=1, step=0)
    start, stop = sorted(int(f * rows) for f in cut)
    stop = max(stop, start + 1) if start < rows else rows
    start = min(start, rows - 1)
    shard = ShardFile(path, record, where=str(path))
    try:
        with pytest.MonkeyPatch.context() as patch:
            if mode == "through the cache":
                patch.setattr(shard.file, "direct_fd", -1)
            elif mode == "around refused":
                patch.setattr(os, "preadv", _refusing_direct_reads(shard))
            (chunk,) = overlaps(placed, 1, start, stop)
            out = empty_rows(placed, start, stop)
            scratch: dict[str, Any] = {}
            shard.read("model/w", placed, chunk, byte_view(out), scratch)
            assert torch.equal(out, tensor[start:stop])
            if mode == "around refused":
                assert not shard.file.direct_works
            elif (
                mode == "around the cache" and shard.file.direct_fd >= 0
            ):  # -1: no O_DIRECT on this file system
                assert shard.file.direct_works and "direct" in scratch and "buffered" not in scratch
    finally:
        shard.close()


def test_the_manifest_has_a_fixed_bound_and_larger_worlds_are_refused_by_name(tmp_path: Path) -> None:
    """At the format's largest world (1,024 pages of 1,024 ranks) the manifest is still small; one
    rank more is refused when writing and when reading, so what a rank reads at start stays bounded."""
    import faccel
    from faccel._checkpoint._manifest import Manifest
    from faccel._checkpoint._save import _use_shards
    from faccel._checkpoint._strategies import strategy_of
    from faccel._checkpoint._verify import check_manifest
    from faccel.errors import ArgumentValueError

    record = FileRecord(size=10**12, digest="f" * 64, algorithm="sha256")
    listed = {name: record for name in expected_files(MAX_SHARDED_WORLD, 2)}
    manifest = manifest_content({"step": 5, "epoch": 1, "position": 0}, MAX_SHARDED_WORLD, listed, 2)
    assert len(manifest["files"]) == 2 + PAGE_RANKS
    assert len(json.dumps(manifest)) < 128 * 1024
    model = torch.nn.Linear(2, 2)
    decoded = Manifest.decode(manifest, where="m")
    found, world, version = check_manifest(decoded, faccel.detect({}), model, where="m")
    assert (world, version) == (MAX_SHARDED_WORLD, 2) and found == listed
    manifest["world_size"] = MAX_SHARDED_WORLD + 1
    with pytest.raises(CheckpointError, match=r"world_size 1048577 is over the sharded format's 1,048,576"):
        Manifest.decode(manifest, where="m")
    huge = faccel.DistState.simulated(rank=0, world_size=MAX_SHARDED_WORLD + 1)
    with pytest.raises(ArgumentValueError, match=r"holds up to 1,048,576 ranks.*sharded=False"):
        _use_shards(strategy_of(model), model, huge, sharded=True)
    assert _use_shards(strategy_of(model), model, huge, sharded=False) is False
    fits = faccel.DistState.simulated(rank=0, world_size=MAX_SHARDED_WORLD)
    assert _use_shards(strategy_of(model), model, fits, sharded=True) is True
