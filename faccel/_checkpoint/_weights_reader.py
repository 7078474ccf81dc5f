"""A checkpoint's model weights read one whole tensor at a time, offline: ``consolidate``'s reader.

Either format: a whole-tensor ``model.safetensors`` (versions 1 and 3) is opened once, hashed
in a streaming pass against the manifest, then read a tensor at a time from that same open
file (a ``replace=True`` save renamed in meanwhile cannot mix in); the sharded format (version
2) is read in chunks from every shard file that holds one, each hash block checked. The
manifest comes from the one reader (``_manifest.read_manifest``); the sharded format's modules
are reached from here only, never from ``_hf``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from faccel._checkpoint._format import MANIFEST, MODEL, STATE, VERSION_SHARDED, shard_name
from faccel._checkpoint._manifest import read_manifest
from faccel._checkpoint._sharded._chunks import Placed, chunks, parse_index, rows_of
from faccel._checkpoint._sharded._flow import Pages
from faccel._checkpoint._sharded._shard_file import ShardFile, byte_view, empty_rows
from faccel._checkpoint._state_file import StateFile
from faccel._storage._durable import MAX_JSON, FileRecord, new_hash, parse_json
from faccel._storage._roots import spot_of
from faccel._storage._safetensors import Header, TensorInfo, header_of_reader
from faccel._storage._store import Reader, Spot
from faccel.errors import CheckpointError

__all__ = ["byte_view", "open_weights"]

_READ_CHUNK = 64 << 20


def open_weights(
    folder: Spot | Path,
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Callable[[str], torch.Tensor], Callable[[], None]]:
    """A checkpoint's model tensors' ``(dtype, shape)``, a function that reads one whole, and one that
    closes: the manifest read once (:func:`read_manifest`), then each tensor read as asked, every
    byte checked (a whole-tensor model file hashed once, then read from that open file; the
    sharded format's chunks by their hash blocks). Any world size, no process group."""
    folder = spot_of(folder)
    manifest = read_manifest(folder)
    records = manifest.files
    if manifest.version != VERSION_SHARDED:
        path = folder / MODEL
        # One open file from the hash on: a replace=True save renamed in meanwhile cannot mix in.
        reader = _open_checked(path, records.get(MODEL))
        try:
            header = header_of_reader(reader, where=str(path))
        except BaseException:
            reader.close()
            raise
        specs = {name: (info.dtype, info.shape) for name, info in header.tensors.items()}
        return (
            specs,
            lambda name: _tensor(reader, header, header.tensors[name]),
            reader.close,
        )
    world = manifest.world_size
    buffer, _ = (folder / STATE).read(records.get(STATE), where=str(folder / STATE), limit=MAX_JSON)
    content = StateFile.decode(
        parse_json(buffer.numpy().tobytes(), str(folder / STATE)), where=str(folder / STATE)
    )
    index = parse_index(content.tensors, world, where=str(folder))
    model: dict[str, Placed] = index.get("model", {})
    pages = Pages(folder, records, world)
    opened: dict[int, ShardFile] = {}
    scratch: dict[str, Any] = {}  # one thread reads: its buffers kept from tensor to tensor

    def read(name: str) -> torch.Tensor:
        placed = model[name]
        for chunk in chunks(placed, world):  # sizes checked against the files before anything is allocated
            if chunk.rank not in opened:
                path = folder / shard_name(chunk.rank)
                opened[chunk.rank] = ShardFile(
                    path, pages.of(chunk.rank)[0], where=str(path), step=content.step
                )
            opened[chunk.rank].info(f"model/{name}", placed, chunk)
        out = empty_rows(placed, 0, rows_of(placed.shape))
        view = byte_view(out)
        width = len(view) // max(1, rows_of(placed.shape))
        for chunk in chunks(placed, world):
            part = view[chunk.start * width : chunk.stop * width]
            opened[chunk.rank].read(f"model/{name}", placed, chunk, part, scratch)
        return out

    def close() -> None:
        for shard in opened.values():
            shard.close()

    return {name: (p.dtype, p.shape) for name, p in model.items()}, read, close


def _open_checked(path: Spot, record: FileRecord | None) -> Reader:
    """A whole-tensor model file, open, its size and hash checked against the manifest in bounded
    pieces; the caller reads the tensors from this open file and closes it."""
    where = str(path)
    if record is None:
        msg = f"{path.parent}/{MANIFEST}: does not list {MODEL}"
        raise CheckpointError(msg)
    reader = path.store.open(path.key, where=where)
    try:
        if reader.size != record.size:
            msg = f"{where}: the file's size differs from the manifest's (truncated or altered)"
            raise CheckpointError(msg)
        digest = new_hash(record.algorithm)
        chunk = bytearray(min(_READ_CHUNK, reader.size))
        for offset in range(0, reader.size, _READ_CHUNK):
            view = memoryview(chunk)[: min(_READ_CHUNK, reader.size - offset)]
            reader.read_into(view, offset)
            digest.update(view)
        if digest.hexdigest() != record.digest:
            msg = f"{where}: the {record.algorithm} checksum differs from the manifest's (corrupted)"
            raise CheckpointError(msg)
    except BaseException:
        reader.close()
        raise
    return reader


def _tensor(reader: Reader, header: Header, info: TensorInfo) -> torch.Tensor:
    """One tensor from the open file whose header is ``header`` (never reopened: a file renamed in
    meanwhile cannot mix in)."""
    if info.end == info.start:
        return torch.empty(info.shape, dtype=info.dtype)
    buffer = torch.empty(info.end - info.start, dtype=torch.uint8)
    reader.read_into(buffer.numpy().data, header.data_start + info.start)
    return buffer.view(info.dtype).reshape(info.shape)
