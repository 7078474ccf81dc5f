"""Which rank writes which tensor of a sharded model's ``save_model``, and into which file.

Pure arithmetic on tensor names, byte sizes and the world size, so every rank
computes the same plan with no communication. :func:`assign` balances the
bytes (the longest-processing-time rule: largest tensor first, each to the
least-loaded rank, ties to the lower rank and the earlier name), which bounds
every rank's load by ``total / world + largest``: when a rank received its last
tensor ``t`` it was the least loaded, so its load before ``t`` was at most the
average of the others' ``(total - t) / world``. :func:`rank_files` cuts each
rank's tensors, in the order the ranks walk them, into files of at most
``max_shard_size`` bytes, numbered rank by rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

import attrs

__all__ = ["PlannedFile", "assign", "rank_files"]


def assign(sizes: Mapping[str, int], world: int) -> dict[str, int]:
    """The rank (``0 <= rank < world``) that writes each tensor of ``sizes`` (name -> bytes).

    Deterministic: the result depends on the names, their order and sizes, and
    ``world`` only. Every name gets exactly one rank, and no rank gets more than
    ``sum(sizes) / world + max(sizes)`` bytes.

    Example:
        >>> assign({"a": 6, "b": 4, "c": 3, "d": 3}, 2)
        {'a': 0, 'b': 1, 'c': 1, 'd': 0}
    """
    if world < 1:
        msg = f"world must be at least 1, got {world}"
        raise ValueError(msg)
    names = list(sizes)
    order = sorted(range(len(names)), key=lambda i: -sizes[names[i]])  # stable: earlier names first
    loads = [(0, rank) for rank in range(world)]  # a heap of (bytes so far, rank)
    owner: dict[str, int] = {}
    for index in order:
        load, rank = heapq.heappop(loads)
        owner[names[index]] = rank
        heapq.heappush(loads, (load + sizes[names[index]], rank))
    return {name: owner[name] for name in names}


@attrs.frozen(kw_only=True)
class PlannedFile:
    """One weight file of a sharded save: the rank that writes it and its tensors, in file order."""

    rank: int
    names: tuple[str, ...]


def rank_files(
    walk: Sequence[str], sizes: Mapping[str, int], owner: Mapping[str, int], world: int, max_shard_size: int
) -> list[PlannedFile]:
    """The files of a sharded save: each rank's tensors, in ``walk`` order, cut at ``max_shard_size``.

    ``walk`` is the order every rank gathers the tensors in; a rank's files are
    consecutive runs of its own tensors in that order, so it writes them one
    after the other as the tensors arrive. Files are numbered rank 0's first; a
    rank with no tensors writes none. No tensors at all: one empty file, rank 0's.

    Example:
        >>> owner = {"a": 0, "b": 1, "c": 0, "d": 0}
        >>> [(f.rank, f.names) for f in rank_files("abcd", dict.fromkeys("abcd", 4), owner, 2, 8)]
        [(0, ('a', 'c')), (0, ('d',)), (1, ('b',))]
    """
    files: list[PlannedFile] = []
    for rank in range(world):
        current: list[str] = []
        used = 0
        for name in (name for name in walk if owner[name] == rank):
            if current and used + sizes[name] > max_shard_size:
                files.append(PlannedFile(rank=rank, names=tuple(current)))
                current, used = [], 0
            current.append(name)
            used += sizes[name]
        if current:
            files.append(PlannedFile(rank=rank, names=tuple(current)))
    return files or [PlannedFile(rank=0, names=())]
