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

from collections.abc import Sequence
from typing import Any

import torch

from faccel._collectives import gather_sizes
from faccel._data import PreparedLoader
from faccel._sharding import Sharding
from faccel._state import DistState
from faccel._tree import flatten_with_paths, rebuild
from faccel.errors import ArgumentValueError

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


def _one_per_data_rank(dist: DistState, gathered: Any, sizes: list[list[int]]) -> tuple[Any, list[list[int]]]:
    """Keep the rows of the first rank of each tensor-parallel group: the others repeat its batch.

    Those ranks (tensor coordinate 0) are ``0, T, 2T, ...``, data-parallel
    ranks ``0, 1, 2, ...`` in that order, which is the order the loader's plan expects.
    """
    layout = dist.parallel
    keep = [rank for rank in range(dist.world_size) if layout.coordinates(rank)[2] == 0]
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


def gather_for_metrics(
    dist: DistState,
    tree: Any,
    loader: PreparedLoader,
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
    (``batch=k``) or batches (``batch=None``). Under a layout with tensor
    parallelism, the ranks of one tensor-parallel group read the same batches:
    one copy of their rows is kept. Under ``even_batches=False``
    ranks may have different numbers of batches: call it once with
    ``batch=None`` at the end, or pass empty tensors (zero rows, the same other
    dims) on ranks without batch ``k``.

    Args:
        dist: This process's state.
        tree: This rank's outputs: a tensor or nested containers of tensors.
        loader: The prepared evaluation loader the outputs came from.
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
        ArgumentError: A leaf is not a tensor.

    Example:
        >>> import torch, faccel
        >>> data = torch.utils.data.TensorDataset(torch.arange(5.0))
        >>> dist = faccel.detect({})
        >>> loader = faccel.prepare(dist, torch.utils.data.DataLoader(data, batch_size=2))
        >>> outs = [gather_for_metrics(dist, 2 * x, loader, batch=k) for k, (x,) in enumerate(loader)]
        >>> torch.cat(outs).tolist()
        [0.0, 2.0, 4.0, 6.0, 8.0]
    """
    call = f"gather_for_metrics(batch={batch}, epoch={loader.epoch}, start={loader.start})"
    gathered, sizes = gather_sizes(dist, tree, call=call)
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
    if sharding.num_samples == 0 and any(counts):
        msg = (
            "the loader's dataset has no length (an IterableDataset without __len__), so padding "
            "cannot be told apart from samples; give the dataset a __len__, or use faccel.gather"
        )
        raise ArgumentValueError(msg)
    rows, positions = metrics_plan(sharding, counts, batch=batch, start=loader.start)
    if len(rows) != sum(counts) or not torch.equal(rows, torch.arange(len(rows))):
        leaves = [leaf.index_select(0, rows.to(leaf.device)) for leaf in leaves]
        gathered = rebuild(gathered, leaves)
    if with_indices:
        return gathered, sharding.order(loader.epoch)[positions]
    return gathered
