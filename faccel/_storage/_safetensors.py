"""The safetensors format, written straight from tensor memory and read into one buffer.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets"}}``,
padded with spaces to a multiple of 8), then the tensors' bytes back to back.
``safetensors.torch.save_file`` first copies every tensor into one ``bytes``
object; writing the header and then each tensor's own memory skips that copy
(a checkpoint's largest cost after the disk). Tensors are laid out largest
element size first, so every tensor starts aligned to its element size and
reads back as a zero-copy view. Files written here load with the
``safetensors`` library and Hugging Face tools, and theirs load here.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from faccel._storage._durable import parse_json
from faccel._storage._local import LOCAL
from faccel._storage._store import Reader, Spot
from faccel.errors import CheckpointError

__all__ = [
    "DTYPE_CODES",
    "Header",
    "TensorInfo",
    "dtype_of_code",
    "header_of_reader",
    "open_file",
    "parse_header",
    "plan",
    "read_from",
    "read_header",
    "read_tensors",
    "tensor_views",
    "valid_shape",
]

# torch dtype -> safetensors dtype code (the format's own names).
DTYPE_CODES: Mapping[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.complex64: "C64",
}
_CODE_DTYPES: Mapping[str, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}


def dtype_of_code(code: object, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code, or :class:`CheckpointError`."""
    dtype = _CODE_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        msg = f"{where}: unknown tensor dtype {code!r}; expected one of {sorted(_CODE_DTYPES)}"
        raise CheckpointError(msg)
    return dtype


# The format allows up to 100 MB of header; a larger claim means a foreign or corrupt file.
_MAX_HEADER = 100_000_000
_READ_CHUNK = 64 << 20
# A shape's dimensions: at most as many as NumPy allows, and their product (zero sizes counted
# as one) small enough that no stride or size computed from it overflows 64 bits.
_MAX_DIMS = 64
_MAX_SPAN = 1 << 56


def valid_shape(value: object) -> tuple[int, ...] | None:
    """``value`` as a shape when it is a list of at most 64 non-negative ints whose product,
    zero sizes counted as one, stays below 2^56 (so that no stride overflows); else None.

    Example:
        >>> valid_shape([2, 0, 3]), valid_shape([0, 2**64]), valid_shape([-1]), valid_shape("2")
        ((2, 0, 3), None, None, None)
    """
    if type(value) is not list or len(value) > _MAX_DIMS:
        return None
    span = 1
    for size in value:
        if type(size) is not int or not 0 <= size < _MAX_SPAN:
            return None
        span *= max(size, 1)
        if span >= _MAX_SPAN:
            return None
    return tuple(value)


@attrs.frozen(kw_only=True)
class TensorInfo:
    """Where a tensor lies in a file: dtype, shape and byte range within the data section."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


@attrs.frozen(kw_only=True)
class Header:
    """A parsed header: the tensors, the string metadata, and where the data section starts."""

    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    data_start: int


def raw_bytes(tensor: torch.Tensor) -> Any:
    """The tensor's bytes as a NumPy view (a copy only when it is not contiguous CPU memory)."""
    flat = tensor.detach()
    if flat.device.type != "cpu":
        flat = flat.cpu()
    flat = flat.resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def plan(tensors: Mapping[str, torch.Tensor], *, metadata: Mapping[str, str] | None = None) -> list[Any]:
    """The chunks (header bytes, then each tensor's bytes) of a safetensors file of ``tensors``.

    Raises :class:`CheckpointError` for a dtype the format cannot hold.
    """
    if sys.byteorder != "little":  # pragma: no cover - no big-endian CI
        msg = "faccel writes safetensors (little-endian) only on little-endian machines"
        raise CheckpointError(msg)
    order = sorted(tensors, key=lambda name: -tensors[name].element_size())
    specs = {name: (tensors[name].dtype, tuple(tensors[name].shape)) for name in order}
    chunks: list[Any] = [header_bytes(specs, order, metadata)]
    chunks.extend(raw_bytes(tensors[name]) for name in order if tensors[name].numel())
    return chunks


def header_bytes(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    order: list[str],
    metadata: Mapping[str, str] | None = None,
) -> bytes:
    """A safetensors header (length prefix included) for tensors of ``specs``, laid out in ``order``.

    Raises :class:`CheckpointError` for a dtype the format cannot hold.

    Example:
        >>> import torch
        >>> head = header_bytes({"w": (torch.float32, (2, 3))}, ["w"])
        >>> int.from_bytes(head[:8], "little") == len(head) - 8, len(head) % 8
        (True, 0)
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name in order:
        dtype, shape = specs[name]
        if dtype not in DTYPE_CODES:
            msg = f"tensor {name!r} has dtype {dtype}, which safetensors cannot store"
            raise CheckpointError(msg)
        size = dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {
            "dtype": DTYPE_CODES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _bad(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: not a valid safetensors file: {what}")


def parse_header(prefix: bytes | memoryview, file_size: int, *, where: str) -> Header:
    """Parse and check the header at the start of a file of ``file_size`` bytes.

    ``prefix`` must hold at least the first ``8 + N`` bytes. Checks that the
    tensors tile the data section exactly, as the safetensors library does.
    """
    if file_size < 8 or len(prefix) < 8:
        raise _bad(where, f"{file_size} bytes is shorter than the 8-byte header length")
    (length,) = struct.unpack("<Q", bytes(prefix[:8]))
    if length > _MAX_HEADER or 8 + length > file_size or 8 + length > len(prefix):
        raise _bad(where, f"a header of {length} bytes does not fit a file of {file_size} bytes")
    try:
        raw = parse_json(prefix[8 : 8 + length], where)
    except CheckpointError as error:
        raise _bad(where, f"the header is {str(error).removeprefix(where + ': ')}") from None
    if not isinstance(raw, dict):
        raise _bad(where, "the header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _bad(where, "__metadata__ must map strings to strings")
    infos: dict[str, TensorInfo] = {}
    for name, entry in raw.items():
        infos[name] = _info(name, entry, where)
    expected = 0
    for name, info in sorted(infos.items(), key=lambda item: (item[1].start, item[1].end)):
        if info.start != expected:
            raise _bad(where, f"tensor {name!r} starts at byte {info.start}, expected {expected}")
        expected = info.end
    if 8 + length + expected != file_size:
        raise _bad(
            where, f"the tensors need {8 + length + expected} bytes but the file has {file_size} (truncated?)"
        )
    return Header(tensors=infos, metadata=metadata, data_start=8 + length)


def _info(name: str, entry: Any, where: str) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise _bad(where, f"entry {name!r} needs exactly dtype, shape and data_offsets")
    dtype = dtype_of_code(entry["dtype"], f"{where}: tensor {name!r}")
    shape, offsets = valid_shape(entry["shape"]), entry["data_offsets"]
    if shape is None:
        raise _bad(where, f"tensor {name!r} has a malformed or oversized shape {entry['shape']!r:.60}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int and o >= 0 for o in offsets)
        or offsets[1] < offsets[0]
    ):
        raise _bad(where, f"tensor {name!r} has malformed data_offsets {offsets!r:.60}")
    itemsize = dtype.itemsize
    if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
        raise _bad(where, f"tensor {name!r}: data_offsets do not match shape {list(shape)} of {dtype}")
    return TensorInfo(dtype=dtype, shape=shape, start=offsets[0], end=offsets[1])


def tensor_views(buffer: torch.Tensor, header: Header) -> dict[str, torch.Tensor]:
    """Each tensor of a file read into ``buffer`` (uint8), as a view where aligned."""
    out: dict[str, torch.Tensor] = {}
    for name, info in header.tensors.items():
        if info.start == info.end:
            out[name] = torch.empty(info.shape, dtype=info.dtype)
            continue
        piece = buffer[header.data_start + info.start : header.data_start + info.end]
        itemsize = info.dtype.itemsize
        if piece.storage_offset() % itemsize:
            piece = piece.clone()  # a foreign file with unaligned tensors
        out[name] = piece.view(info.dtype).reshape(info.shape)
    return out


def open_file(file: Path | Spot, *, where: str, within: Sequence[Path] = ()) -> Reader:
    """``file`` open for ranged reads, its size the store's own: a path or a local :class:`Spot`
    through ``_durable.open_regular`` (a regular file, links as ``within`` allows), an object through
    its store (each read bounded by the size the store reports)."""
    if isinstance(file, Spot) and not file.store.local:
        return file.store.open(file.key, where=where)
    key = file.key if isinstance(file, Spot) else os.fspath(file)
    return LOCAL.open(key, where=where, within=within, direct=False)  # one descriptor, as a pread needs


def header_of_reader(reader: Reader, *, where: str) -> Header:
    """The checked header of the open file ``reader`` (at most the header's bytes are read)."""
    head = bytearray(min(8, reader.size))
    reader.read_into(head, 0)
    if len(head) == 8:
        (length,) = struct.unpack("<Q", head)
        if length <= _MAX_HEADER and 8 + length <= reader.size:  # else parse_header says why
            rest = bytearray(length)
            reader.read_into(rest, 8)
            head += rest
    return parse_header(memoryview(head), reader.size, where=where)


def read_header(file: Path | Spot, *, where: str, within: Sequence[Path] = ()) -> Header:
    """Read and check only the header of the safetensors file at ``file`` (a path, or a :class:`Spot`
    of any store), opened as :func:`open_file` opens it; at most the header's bytes are read."""
    reader = open_file(file, where=where, within=within)
    try:
        return header_of_reader(reader, where=where)
    finally:
        reader.close()


def read_from(reader: Reader, header: Header, infos: Mapping[str, TensorInfo]) -> dict[str, torch.Tensor]:
    """The tensors named in ``infos`` from the open file ``reader`` whose header is ``header``, each
    into its own buffer by ranged reads of its bytes (at most 64 MiB a read).

    Reading from one open file, never reopening its path, is what keeps a
    file checked once the file read: a writer that renames another file into
    its place does not change what an open file holds.
    """
    out: dict[str, torch.Tensor] = {}
    for name, info in infos.items():
        buffer = torch.empty(info.end - info.start, dtype=torch.uint8)
        view = buffer.numpy().data
        start = header.data_start + info.start
        for offset in range(0, len(view), _READ_CHUNK):
            reader.read_into(view[offset : offset + _READ_CHUNK], start + offset)
        out[name] = (
            buffer.view(info.dtype).reshape(info.shape)
            if len(view)
            else torch.empty(info.shape, dtype=info.dtype)
        )
    return out


def read_tensors(
    file: Path | Spot, infos: Mapping[str, TensorInfo], *, where: str, within: Sequence[Path] = ()
) -> dict[str, torch.Tensor]:
    """The tensors named in ``infos`` of the file at ``file`` (a path, or a :class:`Spot` of any
    store), as its header was read before.

    Only those tensors' bytes are read (each into its own aligned buffer), so
    memory is bounded by what is asked for, not by the file's size. The file's
    header must still say ``infos`` (else :class:`CheckpointError`: it changed
    since it was checked).
    """
    reader = open_file(file, where=where, within=within)
    try:
        header = header_of_reader(reader, where=where)
        if any(header.tensors.get(name) != info for name, info in infos.items()):
            msg = f"{where}: the file changed since its header was checked; load again"
            raise CheckpointError(msg)
        return read_from(reader, header, infos)
    finally:
        reader.close()
