"""Where each tensor of a sharded checkpoint lies: chunks of rows, assigned to the ranks that write them.

A tensor of a sharded checkpoint (format version 2) is cut along its first
dimension into chunks of ``block`` rows: chunk ``i`` holds rows
``[i * block, min((i + 1) * block, rows))`` and is written by rank
``(first + i) % world``. A 0-d tensor counts as one row. Two integers per
tensor say where every byte of it is, at any world size, so the index grows
with the model and never with the number of ranks.

The rule fits the two ways a state is held:

- an FSDP2 (DTensor ``Shard(0)``) tensor: ``block = ceil(rows / world)``,
  ``first = 0``, exactly how ``torch.chunk`` (and so DTensor) splits it: each
  rank writes its own local shard, as it holds it;
- a replicated tensor (DDP, one process, FSDP2's unsharded buffers and 0-d
  optimizer steps): every rank holds it whole, so :func:`assign` gives each
  tensor to one rank (or, a tensor larger than a rank's even share, its rows
  to all ranks), balancing the bytes each rank writes.

A reader asks :func:`overlaps` which chunks cover the rows it needs.
Within a chunk every ``hash_rows`` rows have their own SHA-256, so a reader
of part of a chunk verifies every byte it uses while reading at most one
hash block more at each end. Nothing here does I/O.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs
import torch

from faccel._storage._safetensors import DTYPE_CODES, dtype_of_code, valid_shape
from faccel._torch_compat import is_dtensor, local_rows
from faccel.errors import CheckpointError

__all__ = [
    "HASH_BYTES",
    "Chunk",
    "Held",
    "Placed",
    "assign",
    "chunks",
    "hash_rows",
    "held_rows",
    "overlaps",
    "parse_index",
    "row_split",
    "rows_of",
    "split_by_rows",
]

# Bytes per hash block: small enough that a partial read wastes little, large enough that
# hashing runs at full speed.
HASH_BYTES = 4 << 20


@attrs.frozen(kw_only=True)
class Placed:
    """A tensor of the checkpoint: dtype, global shape, and the chunk rule ``(block, first)``."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    block: int
    first: int

    def to_json(self) -> dict[str, Any]:
        """The index entry (``state.json``'s ``tensors``) of this tensor."""
        return {
            "dtype": DTYPE_CODES[self.dtype],
            "shape": list(self.shape),
            "block": self.block,
            "first": self.first,
        }


@attrs.frozen(kw_only=True, eq=False)
class Held:
    """Where a pipeline stage's tensor lies in a sharded checkpoint (``_strategies/_pipeline.py``).

    The ``ranks`` consecutive ranks from ``first`` hold the stage; the tensor is cut into chunks
    of ``block`` rows, chunk ``i`` written by rank ``first + i`` (the chunk rule's ``block`` and
    ``first``). ``cut``: on a rank of the stage, what gives the chunk this rank writes (None past
    the last row), called only by a checkpoint's plan (a collective of the stage's ranks where the
    tensor must be made whole first; an export never calls it). Set on the state's tensor under the
    mark ``WRITTEN_BY`` (``faccel._marks``), which the strategy state reads back (``held``).

    Example:
        >>> held = Held(block=3, first=2, ranks=2)
        >>> held.chunk_of(3, rows=5), held.chunk_of(0, rows=5), held.piece()
        ((3, 5), None, None)
    """

    block: int
    first: int
    ranks: int
    cut: Callable[[], torch.Tensor | None] | None = None

    def piece(self) -> torch.Tensor | None:
        """The rows this rank writes (``cut``'s), or None (another stage's tensor, or none of its rows)."""
        return self.cut() if self.cut is not None else None

    def chunk_of(self, rank: int, *, rows: int) -> tuple[int, int] | None:
        """The rows ``rank`` writes, or None (not the stage's rank, or past the last row)."""
        index = rank - self.first
        start = index * self.block
        if not 0 <= index < self.ranks or start >= rows:
            return None
        return start, min(rows, start + self.block)


@attrs.frozen(kw_only=True)
class Chunk:
    """Rows ``[start, stop)`` of a tensor, written by ``rank``; ``[use_start, use_stop)`` the rows wanted."""

    rank: int
    start: int
    stop: int
    use_start: int
    use_stop: int


def rows_of(shape: tuple[int, ...]) -> int:
    """Rows of a tensor of ``shape`` (a 0-d tensor is one row).

    Example:
        >>> rows_of((6, 4)), rows_of(())
        (6, 1)
    """
    return shape[0] if shape else 1


def row_bytes(placed: Placed) -> int:
    """Bytes of one row of ``placed``."""
    return math.prod(placed.shape[1:]) * placed.dtype.itemsize


def hash_rows(placed: Placed) -> int:
    """Rows per hash block of ``placed``: about :data:`HASH_BYTES`, at least one row.

    Example:
        >>> import torch
        >>> hash_rows(Placed(dtype=torch.float32, shape=(10**6, 1024), block=10**6, first=0))
        1024
    """
    return max(1, HASH_BYTES // max(1, row_bytes(placed)))


def chunks(placed: Placed, world: int) -> list[Chunk]:
    """Every non-empty chunk of ``placed`` in a checkpoint of ``world`` ranks.

    Example:
        >>> import torch
        >>> placed = Placed(dtype=torch.float32, shape=(5,), block=2, first=1)
        >>> [(c.rank, c.start, c.stop) for c in chunks(placed, 2)]
        [(1, 0, 2), (0, 2, 4), (1, 4, 5)]
    """
    return overlaps(placed, world, 0, rows_of(placed.shape))


def overlaps(placed: Placed, world: int, start: int, stop: int) -> list[Chunk]:
    """The chunks of ``placed`` that hold rows ``[start, stop)``, each with the part wanted.

    Example:
        >>> import torch
        >>> placed = Placed(dtype=torch.float32, shape=(10, 3), block=4, first=0)
        >>> [(c.rank, c.start, c.stop, c.use_start, c.use_stop) for c in overlaps(placed, 3, 3, 9)]
        [(0, 0, 4, 3, 4), (1, 4, 8, 4, 8), (2, 8, 10, 8, 9)]
    """
    rows, block = rows_of(placed.shape), placed.block
    stop = min(stop, rows)
    found = []
    for i in range(start // block, -(-stop // block) if stop > start else start // block):
        low, high = i * block, min(rows, (i + 1) * block)
        found.append(
            Chunk(
                rank=(placed.first + i) % world,
                start=low,
                stop=high,
                use_start=max(start, low),
                use_stop=min(stop, high),
            )
        )
    return found


def assign(
    tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], sharded: Iterable[str], world: int
) -> dict[str, Placed]:
    """The chunk rule of every tensor: ``sharded`` ones as DTensor splits them, the rest balanced.

    Replicated tensors go whole to the rank that has written the fewest bytes
    so far (largest first); one larger than a rank's even share of the total
    is split into ``world`` chunks of rows instead. The same input gives the
    same rule on every rank, with no communication.

    Example:
        >>> import torch
        >>> specs = {"a": (torch.float32, (8, 2)), "b": (torch.float32, (2,)), "c": (torch.float32, (3,))}
        >>> {k: (p.block, p.first) for k, p in assign(specs, [], 2).items()}
        {'a': (4, 0), 'b': (2, 1), 'c': (3, 0)}
    """
    shard = set(sharded)
    placed: dict[str, Placed] = {}
    loads = [0] * world
    sizes = {key: math.prod(shape) * dtype.itemsize for key, (dtype, shape) in tensors.items()}
    for key in tensors:
        if key in shard:
            dtype, shape = tensors[key]
            block = max(1, -(-rows_of(shape) // world))
            placed[key] = Placed(dtype=dtype, shape=shape, block=block, first=0)
            for chunk in chunks(placed[key], world):
                loads[chunk.rank] += sizes[key] * (chunk.stop - chunk.start) // max(1, rows_of(shape))
    share = sum(sizes[key] for key in tensors if key not in shard) / world
    heap = [(load, rank) for rank, load in enumerate(loads)]
    heapq.heapify(heap)
    for key in sorted((k for k in tensors if k not in shard), key=lambda k: (-sizes[k], k)):
        dtype, shape = tensors[key]
        rows = rows_of(shape)
        if world > 1 and sizes[key] > share and rows >= world:
            placed[key] = Placed(dtype=dtype, shape=shape, block=-(-rows // world), first=0)
            heap = [(load + sizes[key] // world, rank) for load, rank in heap]
            heapq.heapify(heap)
            continue
        load, rank = heapq.heappop(heap)
        placed[key] = Placed(dtype=dtype, shape=shape, block=max(1, rows), first=rank)
        heapq.heappush(heap, (load + sizes[key], rank))
    return {key: placed[key] for key in tensors}


def row_split(tensor: Any, world: int) -> bool:
    """Whether ``tensor`` is a DTensor split by rows over all ``world`` ranks, as FSDP2 shards:
    one mesh dimension of ``world`` ranks in order, ``Shard(0)``.

    Example:
        >>> import torch
        >>> row_split(torch.zeros(2), 1)
        False
    """
    if not is_dtensor(tensor):
        return False
    from torch.distributed.tensor import Shard

    mesh = tensor.device_mesh
    return (
        mesh.ndim == 1
        and mesh.mesh.flatten().tolist() == list(range(world))
        and len(tensor.placements) == 1
        and isinstance(tensor.placements[0], Shard)
        and tensor.placements[0].dim == 0
        and tensor.dim() > 0
    )


def split_by_rows(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor split by rows over one mesh dimension (``Shard(0)``), whatever
    its ranks: each rank's part is one run of rows (``local_rows``), as FSDP2 shards a pipeline
    stage over the ranks of its block.

    Example:
        >>> import torch
        >>> split_by_rows(torch.zeros(2))
        False
    """
    if not is_dtensor(tensor):
        return False
    from torch.distributed.tensor import Shard

    return (
        tensor.device_mesh.ndim == 1
        and len(tensor.placements) == 1
        and type(tensor.placements[0]) is Shard
        and tensor.placements[0].dim == 0
        and tensor.dim() > 0
    )


def held_rows(tensor: Any) -> tuple[int, int] | None:
    """The run of whole rows ``(start, stop)`` that this rank's part of DTensor ``tensor`` is, or None.

    A DTensor whose every placement is ``Shard(0)``, ``Replicate`` or over a mesh dimension of one
    rank (which splits nothing) holds one run of whole rows, on any mesh: FSDP2's rows, a
    column-parallel layer's rows under tensor parallelism, with replicas (HSDP) or not. Any other
    placement (a row-parallel layer's ``Shard(1)``, FSDP2 over a tensor-parallel ``Shard(0)``,
    whose rows interleave) is not one run: None, and the reader takes the whole tensor. A plain
    tensor: None. (The writers ask :func:`split_by_rows`, stricter: there each run of rows must be
    one rank's alone, so that no row is written twice.)

    Example:
        >>> import torch
        >>> held_rows(torch.zeros(2)) is None
        True
    """
    if not is_dtensor(tensor) or tensor.dim() == 0:
        return None
    from torch.distributed.tensor import Replicate, Shard

    placed = zip(tensor.placements, tensor.device_mesh.shape, strict=True)
    if not all(n == 1 or type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p, n in placed):
        return None
    return local_rows(tensor)


def parse_index(raw: Any, world: int, *, where: str) -> dict[str, dict[str, Placed]]:
    """``state.json``'s ``tensors`` (``{group: {key: entry}}``) checked, or :class:`CheckpointError`.

    Example:
        >>> entry = {"dtype": "F32", "shape": [4], "block": 2, "first": 1}
        >>> index = parse_index({"m": {"w": entry}}, 2, where="x")
        >>> index["m"]["w"].block
        2
    """
    if not isinstance(raw, dict) or not all(isinstance(group, dict) for group in raw.values()):
        msg = f"{where}: tensors must map groups to {{key: entry}} objects"
        raise CheckpointError(msg)
    out: dict[str, dict[str, Placed]] = {}
    for group, entries in raw.items():
        out[group] = {}
        for key, entry in entries.items():
            shape = valid_shape(entry.get("shape")) if isinstance(entry, dict) else None
            block = entry.get("block") if isinstance(entry, dict) else None
            first = entry.get("first") if isinstance(entry, dict) else None
            if (
                shape is None
                or type(block) is not int
                or type(first) is not int
                or not block >= 1
                or not 0 <= first < world
                or -(-rows_of(shape) // block) > world
            ):
                msg = (
                    f"{where}: tensor {group}/{key} needs a shape, a block >= 1 of at most {world} "
                    f"chunks and a first rank below {world}, got {entry!r:.100}"
                )
                raise CheckpointError(msg)
            dtype = dtype_of_code(entry.get("dtype"), f"{where}: tensor {group}/{key}")
            out[group][key] = Placed(dtype=dtype, shape=shape, block=block, first=first)
    return out
