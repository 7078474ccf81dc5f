"""A rank's shard file: its chunks as safetensors, every hash block's SHA-256 in the header.

``shard-RANK.safetensors`` (format version 2) is a standard safetensors file
holding the chunks rank RANK writes (``_chunks``), each under its tensor's
key (``model/<name>``, ``optimizer/<key>``) with the chunk's own shape. Its
``__metadata__`` holds ``{"faccel": JSON}`` with, for each chunk, the rows per
hash block, the SHA-256 of each block and the chunk's rows of the global
tensor, and the step of the save: a reader checks those rows against the ones
the index (``state.json``) sends it to, and the step against the checkpoint's,
so that neither an edited chunk rule nor a shard copied in from another save
of consistent size goes unseen (files written before these fields, without
them, are read as before). The header's own SHA-256 (and the
file's size) goes to the checkpoint's rank pages, so the chain manifest ->
page -> header -> block covers every byte a reader uses.

Writing (:func:`write_shard`) streams each chunk from the tensor's own memory
(through ``SyncedWriter``, which starts the disk early) while a second thread
hashes the blocks; the header, whose length does not
depend on the hashes (fixed-width hex), is written first with placeholders and
rewritten in place at the end. Reading (:class:`ShardFile`) checks the header
against its record, then reads only the byte ranges of the rows asked for,
rounded out to whole hash blocks, and checks each block before its bytes are
used. Blocks are read around the page cache (``O_DIRECT``, into a page-aligned
scratch block per thread, then copied into place) where the file system
allows it: a restore reads each byte once, so the cache would only cost a
second copy and the kernel's work of filling it (on the 2-core test machine,
most of a cold restore's time). Elsewhere, or when the file system refuses
an aligned read, blocks go through the cache, straight into place.
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from faccel._checkpoint._sharded._chunks import (
    Chunk,
    Placed,
    chunks,
    hash_rows,
    row_bytes,
    rows_of,
)
from faccel._storage._durable import SHA256, FileRecord, parse_json, scratch_buffer
from faccel._storage._roots import spot_of
from faccel._storage._safetensors import (
    DTYPE_CODES,
    Header,
    TensorInfo,
    header_bytes,
    parse_header,
    raw_bytes,
)
from faccel._storage._store import Reader, Spot
from faccel.errors import CheckpointError

__all__ = ["ShardFile", "write_shard"]

_META = "faccel"
_PLACEHOLDER = "0" * 64
_MAX_HEADER = 100_000_000


def _header(
    pieces: Mapping[str, torch.Tensor],
    order: list[str],
    hashes: Mapping[str, list[str]],
    per: Mapping[str, int],
    rows: Mapping[str, list[int]],
    step: int,
) -> bytes:
    fields = {"hash_rows": dict(per), "sha256": dict(hashes), "rows": dict(rows), "step": step}
    meta = json.dumps(fields, separators=(",", ":"))
    specs = {name: (pieces[name].dtype, tuple(pieces[name].shape)) for name in order}
    return header_bytes(specs, order, {_META: meta})


def _sha(view: Any) -> str:
    return hashlib.sha256(view).hexdigest()


def write_shard(
    path: Spot | Path,
    pieces: Mapping[str, torch.Tensor],
    placed: Mapping[str, Placed],
    *,
    rank: int,
    world: int,
    step: int,
) -> FileRecord:
    """Write rank ``rank``'s chunks of step ``step``'s save to a new file at ``path`` and fsync it.

    ``pieces`` maps each key to the chunk's tensor (rows of the global tensor,
    contiguous); ``placed`` gives each key's global tensor (for the rows per
    hash block, and, with ``world``, the chunk's rows). The caller fsyncs the
    folder. Returns the file's size and the SHA-256 of its header.

    Raises :class:`CheckpointError` for a dtype safetensors cannot hold.
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        msg = "faccel writes safetensors (little-endian) only on little-endian machines"
        raise CheckpointError(msg)
    for name, tensor in pieces.items():
        if tensor.dtype not in DTYPE_CODES:
            msg = f"tensor {name!r} has dtype {tensor.dtype}, which safetensors cannot store"
            raise CheckpointError(msg)
    order = sorted(pieces, key=lambda name: -pieces[name].element_size())
    per = {name: hash_rows(placed[name]) for name in order}
    rows = {name: _own_rows(placed[name], world, rank) for name in order}
    counts = {
        name: -(-rows_of(tuple(pieces[name].shape)) // per[name]) if pieces[name].numel() else 0
        for name in order
    }
    draft = _header(pieces, order, {name: [_PLACEHOLDER] * counts[name] for name in order}, per, rows, step)
    futures: dict[str, list[Future[str]]] = {name: [] for name in order}
    spot = spot_of(path)
    with (
        spot.store.writer(spot.key) as out,
        ThreadPoolExecutor(max_workers=1, thread_name_prefix="faccel-hash") as hasher,
    ):
        out.write(draft)
        for name in order:
            tensor = pieces[name]
            if not tensor.numel():
                continue
            data = memoryview(raw_bytes(tensor)).cast("B")
            stride = per[name] * (len(data) // rows_of(tuple(tensor.shape)))  # bytes per hash block
            for start in range(0, len(data), stride):
                block = data[start : start + stride]
                futures[name].append(hasher.submit(_sha, block))  # hashed while written
                out.write(block)
        hashes = {name: [future.result() for future in futures[name]] for name in order}
        final = _header(pieces, order, hashes, per, rows, step)
        if len(final) != len(draft):  # pragma: no cover - fixed-width hex cannot change the length
            msg = f"{path}: the shard header changed length"
            raise CheckpointError(msg)
        out.patch_head(final)
        size = out.close()
    return FileRecord(size=size, digest=hashlib.sha256(final).hexdigest(), algorithm=SHA256)


def _own_rows(placed: Placed, world: int, rank: int) -> list[int]:
    """``[start, stop)`` of ``rank``'s chunk of ``placed`` (a rank writes at most one per tensor)."""
    own = [[c.start, c.stop] for c in chunks(placed, world) if c.rank == rank]
    return own[0] if own else [0, 0]


class ShardFile:
    """One writer rank's shard file, open for reading: header checked against its record.

    Holds the descriptor until :meth:`close`; :meth:`read` fills rows of a
    tensor into a caller's buffer, checking every hash block it touches.
    """

    def __init__(self, path: Spot | Path, record: FileRecord, *, where: str, step: Any = None) -> None:
        self.where = where
        self.step = step  # the checkpoint's step, which the header must name (None: not checked)
        spot = spot_of(path)
        self.file: Reader = spot.store.open(spot.key, where=where)
        try:
            size = self.file.size  # the store's own account, not the page's
            if size != record.size:
                msg = f"{where}: the file has {size} bytes but its rank page says {record.size} (truncated?)"
                raise CheckpointError(msg)
            if size < 8:
                msg = f"{where}: not a valid safetensors file: {size} bytes"
                raise CheckpointError(msg)
            first = bytearray(8)
            self.file.read_into(first, 0)
            length = struct.unpack("<Q", first)[0]
            if length > _MAX_HEADER or 8 + length > size:
                msg = f"{where}: not a valid safetensors file: a header of {length} bytes in {size}"
                raise CheckpointError(msg)
            rest = bytearray(length)
            self.file.read_into(rest, 8)
            head = bytes(first + rest)
            if hashlib.sha256(head).hexdigest() != record.digest:
                msg = f"{where}: the header's sha256 checksum differs from its rank page's (corrupted)"
                raise CheckpointError(msg)
            self.header: Header = parse_header(head, size, where=where)
            self.per, self.hashes, self.rows = self._hashes(self.header)
        except BaseException:
            self.file.close()
            raise

    def _hashes(self, header: Header) -> tuple[dict[str, int], dict[str, list[str]], dict[str, Any] | None]:
        raw = parse_json(header.metadata.get(_META, "").encode(), f"{self.where}: __metadata__")
        per = raw.get("hash_rows") if isinstance(raw, dict) else None
        hashes = raw.get("sha256") if isinstance(raw, dict) else None
        if not isinstance(per, dict) or not isinstance(hashes, dict):
            msg = f"{self.where}: __metadata__ lacks faccel's hash blocks (not a faccel shard file)"
            raise CheckpointError(msg)
        chunk_rows = raw.get("rows")
        if "rows" in raw or "step" in raw:  # written with them (earlier files have neither)
            step = raw.get("step")
            if not isinstance(chunk_rows, dict) or type(step) is not int:
                msg = f"{self.where}: __metadata__'s rows and step are malformed"
                raise CheckpointError(msg)
            if self.step is not None and step != self.step:
                msg = (
                    f"{self.where}: this shard was written by the save of step {step}, but its "
                    f"checkpoint is step {self.step}: a shard copied in from another save (the "
                    "checkpoint is a mix of two saves, and is not read)"
                )
                raise CheckpointError(msg)
        for name, info in header.tensors.items():
            rows, each, listed = rows_of(info.shape), per.get(name), hashes.get(name)
            count = -(-rows // each) if type(each) is int and each >= 1 and info.end > info.start else 0
            if type(each) is not int or each < 1 or not isinstance(listed, list) or len(listed) != count:
                msg = f"{self.where}: tensor {name!r} has no valid hash blocks in __metadata__"
                raise CheckpointError(msg)
        return per, hashes, chunk_rows

    def close(self) -> None:
        """Close the file."""
        self.file.close()

    def info(self, name: str, placed: Placed, chunk: Chunk) -> TensorInfo:
        """The entry of ``name``'s chunk, checked to be that chunk of ``placed``."""
        info = self.header.tensors.get(name)
        shape = (chunk.stop - chunk.start, *placed.shape[1:]) if placed.shape else ()
        if info is None or info.dtype != placed.dtype or info.shape != shape:
            found = "missing" if info is None else f"{info.dtype} {list(info.shape)}"
            msg = (
                f"{self.where}: tensor {name!r} should hold rows {chunk.start}:{chunk.stop} "
                f"({placed.dtype} {list(shape)}), found {found}"
            )
            raise CheckpointError(msg)
        if self.rows is not None and self.rows.get(name) != [chunk.start, chunk.stop]:
            msg = (
                f"{self.where}: tensor {name!r}: the index (state.json) sends this read to rows "
                f"{chunk.start}:{chunk.stop}, but the shard's header says its chunk is rows "
                f"{self.rows.get(name)} (an edited chunk rule: the rows would come back permuted)"
            )
            raise CheckpointError(msg)
        return info

    def read(
        self, name: str, placed: Placed, chunk: Chunk, out: Any, scratch: dict[str, Any] | None = None
    ) -> None:
        """Rows ``[use_start, use_stop)`` of ``chunk`` into ``out`` (a writable uint8 view of
        exactly those rows' bytes), every hash block they touch checked. ``scratch``: the calling
        thread's buffers, kept between calls (one hash block, page-aligned, per kind of read)."""
        scratch = {} if scratch is None else scratch
        info = self.info(name, placed, chunk)
        width = row_bytes(placed)
        if not width or chunk.use_stop <= chunk.use_start:
            return
        per = self.per[name]
        base = self.header.data_start + info.start
        rows = chunk.stop - chunk.start
        low, high = chunk.use_start - chunk.start, chunk.use_stop - chunk.start
        for block in range(low // per, -(-high // per)):
            first, last = block * per, min(rows, (block + 1) * per)
            inside = low <= first and last <= high
            offset, need = base + first * width, (last - first) * width
            target = self.file.direct(offset, need, scratch)
            in_place = False
            if target is None:  # through the page cache: straight into out when the block is whole
                in_place = inside
                if inside:
                    target = out[(first - low) * width : (last - low) * width]
                else:
                    target = scratch_buffer(scratch, "buffered", need)[:need]
                self.file.read_into(target, offset)
            if _sha(target) != self.hashes[name][block]:
                msg = (
                    f"{self.where}: tensor {name!r}, rows {chunk.start + first}:{chunk.start + last}: the "
                    "sha256 checksum differs from the header's (the file is corrupted)"
                )
                raise CheckpointError(msg)
            if not in_place:
                start, stop = max(first, low), min(last, high)
                out[(start - low) * width : (stop - low) * width] = target[
                    (start - first) * width : (stop - first) * width
                ]


def empty_rows(placed: Placed, start: int, stop: int) -> torch.Tensor:
    """A new tensor for rows ``[start, stop)`` of ``placed`` (the whole 0-d tensor for a 0-d one)."""
    shape = (stop - start, *placed.shape[1:]) if placed.shape else ()
    return torch.empty(shape, dtype=placed.dtype)


def byte_view(tensor: torch.Tensor) -> Any:
    """A writable flat uint8 NumPy view of a contiguous CPU tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else memoryview(bytearray())
