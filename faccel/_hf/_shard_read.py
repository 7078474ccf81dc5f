"""Reading into a sharded model: each rank reads only the rows of its own shards from safetensors.

A DTensor parameter (FSDP2, HSDP, tensor parallelism) holds a box of the
whole tensor on each rank: an offset and a size along each dimension. The box's
rows are a contiguous byte range of the tensor in a safetensors file, so a rank
reads those rows, a bounded block of rows at a time (``BLOCK_BYTES``, at least
one row), and keeps the box's columns of each block. Peak extra memory is one
block; nothing outside the rows of this rank's boxes is read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from faccel._storage._safetensors import TensorInfo, header_of_reader, open_file
from faccel._storage._store import Reader, Spot
from faccel._torch_compat import local_box
from faccel.errors import CheckpointError

__all__ = ["BLOCK_BYTES", "load_rows"]

# The most bytes of a file read at once into one rank's scratch block.
BLOCK_BYTES = 16 * 1024 * 1024


def load_rows(
    path: Path | Spot, targets: Mapping[str, tuple[TensorInfo, Any]], *, within: Sequence[Path] = ()
) -> None:
    """Copy into each DTensor target its box of the tensor in the safetensors file at ``path`` (a
    path, or a :class:`Spot` of any store: an object's rows are ranged GETs), in place.

    ``targets``: name -> (its ``TensorInfo`` as the header was checked, the
    DTensor). The file's header must still say the same (else
    :class:`CheckpointError`: it changed since it was checked).
    """
    where = str(path)
    file = open_file(path, where=where, within=within)
    try:
        header = header_of_reader(file, where=where)
        if any(header.tensors.get(name) != info for name, (info, _) in targets.items()):
            msg = f"{where}: the file changed since its header was checked; load again"
            raise CheckpointError(msg)
        for info, target in targets.values():
            _load_box(file, header.data_start + info.start, info, target)
    finally:
        file.close()


def _load_box(file: Reader, start: int, info: TensorInfo, target: Any) -> None:
    offset, shape = local_box(target)
    local = target.to_local()
    if not local.numel():
        return
    if not info.shape:  # a 0-d tensor: one element
        buffer = torch.empty(info.end - info.start, dtype=torch.uint8)
        file.read_into(buffer.numpy().data, start)
        local.copy_(buffer.view(info.dtype).reshape(()))
        return
    row_shape = info.shape[1:]
    row_bytes = (info.end - info.start) // info.shape[0]
    rows_per_block = max(1, BLOCK_BYTES // max(1, row_bytes))
    columns = tuple(slice(o, o + s) for o, s in zip(offset[1:], shape[1:], strict=True))
    first, stop = offset[0], offset[0] + shape[0]
    scratch = torch.empty(min(rows_per_block, stop - first) * row_bytes, dtype=torch.uint8)
    for row in range(first, stop, rows_per_block):
        count = min(rows_per_block, stop - row)
        block = scratch[: count * row_bytes]
        file.read_into(block.numpy().data, start + row * row_bytes)
        rows = block.view(info.dtype).reshape(count, *row_shape)
        local[row - first : row - first + count].copy_(rows[(slice(None), *columns)])
