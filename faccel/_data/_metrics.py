"""Gathering evaluation outputs: exactly one row per sample, in the epoch's order.

Under ``even_batches`` a prepared loader repeats a few samples so that every
rank has the same number of batches (:class:`~faccel.Sharding`). A plain
:func:`~faccel.gather` of the outputs would count those samples twice and
interleave the ranks' rows. Where each gathered row belongs is a pure function
of the loader's plan: position ``p`` of the epoch went to rank ``p % world``,
rank ``r``'s batch ``k`` holds its positions ``[k*b, (k+1)*b)``, and positions
``>= num_samples`` are padding. :func:`metrics_plan` computes it;
:func:`gather_for_metrics` applies it to gathered tensors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader

from faccel._data._loader import PreparedLoader
from faccel._data._sharding import Sharding
from faccel._dist._collectives import _exchange, gather_sizes
from faccel._dist._layout import DATA_DIMENSIONS, DIMENSIONS
from faccel._dist._state import DistState
from faccel._tree import children, flatten_with_paths, rebuild
from faccel.errors import ArgumentError, ArgumentValueError

__all__ = ["gather_for_metrics", "metrics_plan"]


def _expected_positions(sharding: Sharding, rank: int, batch: int | None, start: int) -> torch.Tensor:
    positions = sharding.positions(rank)
    b = sharding.batch_size
    if batch is None:
        return positions[start * b :]
    return positions[batch * b : (batch + 1) * b]


def metrics_plan(
    sharding: Sharding, counts: Sequence[int], *, batch: int | None = None, start: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which gathered rows are real samples, and their global positions. Pure.

    The gathered rows are every rank's rows concatenated in rank order, rank
    ``r`` contributing ``counts[r]``. With ``batch=k`` each rank's rows are its
    outputs for batch ``k``; with ``batch=None`` they are its outputs for all
    its batches from batch ``start`` on, concatenated.

    Args:
        sharding: The loader's plan (any rank's: only the shared fields are used).
        counts: Rows each rank contributed, in rank order.
        batch: The absolute batch index within the epoch, or None for all batches.
        start: With ``batch=None``, the first batch the rows cover.

    Returns:
        ``(rows, positions)``: indices into the gathered rows, padding dropped and
        sorted by global position, and those positions (ascending).
        ``sharding.order(epoch)[positions]`` are the rows' dataset indices.

    Raises:
        ArgumentValueError: ``counts`` does not match the plan (one count per
            rank, each the rows of that rank's share), or ``batch`` is not a
            batch of this epoch.

    Example:
        >>> import faccel
        >>> plan = faccel.Sharding(num_samples=5, batch_size=2, world_size=2)
        >>> plan.positions(0).tolist(), plan.positions(1).tolist()   # position 5 is padding
        ([0, 2, 4], [1, 3, 5])
        >>> rows, positions = metrics_plan(plan, [3, 3])   # all batches, rank 0's rows first
        >>> rows.tolist(), positions.tolist()
        ([0, 3, 1, 4, 2], [0, 1, 2, 3, 4])
    """
    world = sharding.world_size
    if len(counts) != world:
        msg = f"counts must give one row count per rank ({world}), got {len(counts)}: {list(counts)}"
        raise ArgumentValueError(msg)
    batches = -(-len(sharding.positions(0)) // sharding.batch_size)
    if batch is not None and not 0 <= batch < batches:
        msg = (
            f"batch must be an absolute batch index in [0, {batches}) for this epoch, got {batch}; "
            "pass loader.start + the index from enumerate(loader)"
        )
        raise ArgumentValueError(msg)
    expected = [_expected_positions(sharding, rank, batch, start) for rank in range(world)]
    for rank, (count, positions) in enumerate(zip(counts, expected, strict=True)):
        if count != len(positions):
            where = f"batch {batch}" if batch is not None else f"all batches from batch {start}"
            msg = (
                f"rank {rank} gave {count} rows but its share of {where} holds {len(positions)} "
                f"samples (batch size {sharding.batch_size}, {world} ranks, "
                f"{sharding.num_samples} samples); pass exactly one output row per input sample, "
                "and the absolute batch index (loader.start + enumerate index), or batch=None with "
                "the outputs of every batch the loader view yields"
            )
            raise ArgumentValueError(msg)
    positions = torch.cat(expected) if expected else torch.empty(0, dtype=torch.long)
    real = torch.nonzero(positions < sharding.num_samples).flatten()
    ordered = real[torch.argsort(positions[real])]
    return ordered, positions[ordered]


def _units_plan(
    loader: PreparedLoader, counts: Sequence[int], batch: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """What :func:`metrics_plan` says, for loaders whose batches come whole.

    Those are a batch sampler's batches (their sizes are known from the draw)
    and the items of a loader with ``batch_size=None`` (each rank's item for
    ``batch=k`` holds the rows it gave). A padding batch is dropped whole.
    Returns the rows to keep, in the epoch's order, and their dataset indices.
    """
    s = loader.sharding
    n = s.num_samples
    units = s._drawn(loader.epoch) if s.whole_batches else None
    if units is None and batch is None:
        msg = (
            "this loader has batch_size=None, so how many rows each of its items holds is unknown: "
            "call gather_for_metrics once per batch, with batch=loader.start + the enumerate index"
        )
        raise ArgumentValueError(msg)
    order = s.order(loader.epoch) if units is None else None
    # Sample positions of the real batches in the epoch's order (batch q starts at offsets[q]).
    offsets = [0]
    for unit in units or []:
        offsets.append(offsets[-1] + len(unit))
    widest = max(counts, default=0) + 1
    keys: list[int] = []
    indices: list[int] = []
    real: list[bool] = []
    for rank, count in enumerate(counts):
        positions = s.positions(rank).tolist()
        mine = positions[loader.start :] if batch is None else positions[batch : batch + 1]
        sizes = [count] * len(mine) if units is None else [len(units[q % n]) for q in mine]
        if sum(sizes) != count:
            where = f"batch {batch}" if batch is not None else f"all batches from batch {loader.start}"
            msg = (
                f"rank {rank} gave {count} rows but its share of {where} holds {sum(sizes)} samples "
                f"({len(mine)} whole batches); pass exactly one output row per input sample"
            )
            raise ArgumentValueError(msg)
        for q, size in zip(mine, sizes, strict=True):
            for j in range(size):
                if units is None:
                    assert order is not None
                    keys.append(q * widest + j)
                    indices.append(int(order[q % n]))
                else:
                    keys.append(offsets[q % n] + j)
                    indices.append(units[q % n][j])
                real.append(q < n)
    key = torch.tensor(keys, dtype=torch.long)
    keep = torch.nonzero(torch.tensor(real, dtype=torch.bool)).flatten()
    ordered = keep[torch.argsort(key[keep], stable=True)]
    return ordered, torch.tensor(indices, dtype=torch.long)[ordered]


def _stream_plan(
    sharding: Sharding, counts: Sequence[int], batch: int | None, start: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a padding-free stream of unknown length, sorted by position (= dataset index)."""
    w, b = sharding.world_size, sharding.batch_size
    first = (start if batch is None else batch) * b
    parts = [rank + w * (first + torch.arange(count)) for rank, count in enumerate(counts)]
    positions = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    ordered = torch.argsort(positions)
    return ordered, positions[ordered]


# --- columns of Python objects (generated text, ids) --------------------------------------------


def _is_column(node: Any) -> bool:
    """A list or plain tuple holding no tensor anywhere: one object per row."""
    if not isinstance(node, list | tuple) or hasattr(node, "_fields"):
        return False
    leaves, _, _ = flatten_with_paths(node)
    return not any(isinstance(leaf, torch.Tensor) for leaf in leaves)


def _split_columns(tree: Any, columns: list[list[Any]]) -> Any:
    """``tree`` with each object column replaced by a 1-byte-a-row tensor; the columns appended."""
    if _is_column(tree):
        columns.append(list(tree))
        return torch.zeros(len(tree), dtype=torch.uint8)
    if isinstance(tree, torch.Tensor) or children(tree) is None:
        return tree
    if isinstance(tree, Mapping):
        return {key: _split_columns(value, columns) for key, value in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_split_columns(value, columns) for value in tree))
    if isinstance(tree, list | tuple):
        return type(tree)(_split_columns(value, columns) for value in tree)
    return tree  # a record: its fields stay tensors only (gather says which leaf is not)


def _put_columns(tree: Any, original: Any, columns: Iterator[list[Any]]) -> Any:
    """``tree`` (gathered) with the placeholders of ``original``'s columns replaced by ``columns``."""
    if _is_column(original):
        return type(original)(next(columns))
    if isinstance(original, Mapping):
        return {key: _put_columns(tree[key], value, columns) for key, value in original.items()}
    if isinstance(original, tuple) and hasattr(original, "_fields"):
        return type(original)(*(_put_columns(t, o, columns) for t, o in zip(tree, original, strict=True)))
    if isinstance(original, list | tuple) and not isinstance(original, torch.Tensor):
        return type(original)(_put_columns(t, o, columns) for t, o in zip(tree, original, strict=True))
    return tree


def _gather_columns(dist: DistState, columns: list[list[Any]], call: str) -> list[list[Any]]:
    """Every rank's columns concatenated in rank order: JSON in a byte tensor, no pickle."""
    for column in columns:
        try:
            same = json.loads(json.dumps(column)) == column
        except (TypeError, ValueError):
            same = False
        if not same:
            msg = (
                f"gather_for_metrics sends objects as JSON (no pickle), and {column[:3]!r}... does not "
                "come back equal from JSON (tuples, non-string keys, other types); convert them to "
                "strings, numbers, lists and dicts, or tensors"
            )
            raise ArgumentError(msg)
    if not dist.distributed:
        return columns
    peers = _exchange(dist, {"call": call, "columns": columns})
    if dist.data_world_size != dist.world_size:
        peers = [peers[rank] for rank in _data_ranks(dist)]  # as the tensors' rows were kept
    return [[row for peer in peers for row in peer["columns"][i]] for i in range(len(columns))]


def _one_per_data_rank(dist: DistState, gathered: Any, sizes: list[list[int]]) -> tuple[Any, list[list[int]]]:
    """Keep the rows of the first rank of each tensor-parallel group: the others repeat its batch.

    Those ranks (tensor coordinate 0) are ``0, T, 2T, ...``, data-parallel
    ranks ``0, 1, 2, ...`` in that order, which is the order the loader's plan expects.
    """
    keep = _data_ranks(dist)
    leaves, _, _ = flatten_with_paths(gathered)
    picked = []
    for i, leaf in enumerate(leaves):
        starts = [0]
        for rank_sizes in sizes:
            starts.append(starts[-1] + rank_sizes[i])
        rows = [torch.arange(starts[r], starts[r + 1]) for r in keep]
        index = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        picked.append(leaf.index_select(0, index.to(leaf.device)))
    return rebuild(gathered, picked), [sizes[r] for r in keep]


def _data_ranks(dist: DistState) -> list[int]:
    """One rank per data-parallel rank (coordinate 0 outside the data dimensions), in data-parallel order."""
    layout = dist.parallel
    others = [name for name in DIMENSIONS if name not in DATA_DIMENSIONS]
    return [rank for rank in range(dist.world_size) if not any(layout.coordinate(d, rank) for d in others)]


def gather_for_metrics(
    dist: DistState,
    tree: Any,
    loader: PreparedLoader | DataLoader,  # type: ignore[type-arg]
    *,
    batch: int | None = None,
    with_indices: bool = False,
) -> Any:
    """Gather evaluation outputs with the loader's padding removed, in the epoch's order.

    An evaluation over ``N`` samples yields exactly ``N`` rows, whether called
    once per batch or once on the outputs of the whole epoch. Rows come in the
    epoch's position order: dataset order without shuffling; with shuffling,
    the order the epoch drew (pass ``with_indices=True`` to get each row's
    dataset index as well).

    Every leaf's dim 0 must be one row per input sample of this rank's batch
    (``batch=k``) or batches (``batch=None``). A list (or tuple) of Python
    objects -- generated text, ids -- is a column: one object per row, gathered
    and cut exactly like the tensors (sent as JSON, so strings, numbers, lists
    and dicts; no pickle). With a batch sampler a padding batch is dropped whole;
    with ``batch_size=None`` call it per batch (``batch=k``). Under a layout with
    tensor parallelism, the ranks of one tensor-parallel group read the same
    batches: one copy of their rows is kept. Under ``even_batches=False``
    ranks may have different numbers of batches: call it once with
    ``batch=None`` at the end, or pass empty tensors (zero rows, the same other
    dims) on ranks without batch ``k``.

    Args:
        dist: This process's state.
        tree: This rank's outputs: a tensor or nested containers of tensors and
            object columns.
        loader: The prepared evaluation loader the outputs came from (a loader
            ``faccel.prepare`` returned).
        batch: The absolute batch index in the epoch (``loader.start + i`` for
            ``i, b in enumerate(loader)``); None when ``tree`` holds the outputs
            of every batch the view ``loader`` yields (from ``loader.start``), concatenated.
        with_indices: Also return the dataset index of each row.

    Returns:
        The gathered tree, or ``(tree, indices)`` with ``with_indices=True``.

    Raises:
        DistributedError: As :func:`faccel.gather` (no peers to talk to, or the
            ranks' trees differ in structure, dtype or trailing dims).
        ArgumentValueError: The row counts do not match the loader's plan, a
            rank's leaves have different numbers of rows, ``batch`` is not a
            batch of this epoch, or the loader's dataset has no length (the
            message says what was expected).
        ArgumentError: A leaf is not a tensor (outside an object column), an
            object column does not survive JSON unchanged, or ``loader`` is not
            a prepared loader (a ``DataLoader`` you built: prepare it, or use
            :func:`faccel.gather`).

    Example:
        >>> import torch, faccel
        >>> data = torch.utils.data.TensorDataset(torch.arange(5.0))
        >>> dist = faccel.detect({})
        >>> loader = faccel.prepare(dist, torch.utils.data.DataLoader(data, batch_size=2))
        >>> outs = [gather_for_metrics(dist, 2 * x, loader, batch=k) for k, (x,) in enumerate(loader)]
        >>> torch.cat(outs).tolist()
        [0.0, 2.0, 4.0, 6.0, 8.0]
        >>> texts = [gather_for_metrics(dist, [f"x={int(v)}" for v in x], loader, batch=k)
        ...          for k, (x,) in enumerate(loader)]
        >>> sum(texts, [])
        ['x=0', 'x=1', 'x=2', 'x=3', 'x=4']
    """
    if not isinstance(loader, PreparedLoader):
        msg = (
            f"gather_for_metrics needs the loader faccel.prepare returned (its plan says which rows "
            f"are padding and where each belongs), got a {type(loader).__name__}. Prepare the "
            "DataLoader (any sampler, batch sampler or batch_size=None works, see docs/data.md); for "
            "a loader you shard yourself without padding, gather with faccel.gather (every row "
            "kept, in rank order), or with faccel.gather_object for objects"
        )
        raise ArgumentError(msg)
    call = f"gather_for_metrics(batch={batch}, epoch={loader.epoch}, start={loader.start})"
    columns: list[list[Any]] = []
    tensors = _split_columns(tree, columns)
    gathered, sizes = gather_sizes(dist, tensors, call=call)
    if dist.data_world_size != dist.world_size:
        gathered, sizes = _one_per_data_rank(dist, gathered, sizes)
    sharding = loader.sharding
    counts = []
    leaves, paths, _ = flatten_with_paths(gathered)
    for rank, rank_sizes in enumerate(sizes):
        if len(set(rank_sizes)) > 1:
            detail = ", ".join(f"{p}: {n}" for p, n in zip(paths, rank_sizes, strict=True))
            msg = f"every leaf needs one row per sample, but on rank {rank} dim 0 differs ({detail})"
            raise ArgumentValueError(msg)
        counts.append(rank_sizes[0] if rank_sizes else 0)
    indices: torch.Tensor | None = None
    if loader.batch_size is None:
        rows, indices = _units_plan(loader, counts, batch)
    elif sharding.num_samples == 0 and any(counts):
        if not loader._unsized() or (sharding.even_batches and not sharding.drop_last):
            msg = (
                "the loader's dataset has no length (an IterableDataset without __len__), so padding "
                "cannot be told apart from samples; give the dataset a __len__, or prepare the "
                "loader with even_batches=False (nothing is repeated), or use faccel.gather"
            )
            raise ArgumentValueError(msg)
        rows, indices = _stream_plan(sharding, counts, batch, loader.start)
    else:
        rows, positions = metrics_plan(sharding, counts, batch=batch, start=loader.start)
    if len(rows) != sum(counts) or not torch.equal(rows, torch.arange(len(rows))):
        leaves = [leaf.index_select(0, rows.to(leaf.device)) for leaf in leaves]
        gathered = rebuild(gathered, leaves)
    if columns:
        picked = rows.tolist()
        full = _gather_columns(dist, columns, call)
        gathered = _put_columns(gathered, tree, iter([[column[i] for i in picked] for column in full]))
    if with_indices:
        if indices is None:
            indices = sharding.order(loader.epoch)[positions]
        return gathered, indices
    return gathered
