"""Context parallelism's data: each context rank's load-balanced slice of every sequence, and back. Pure.

Under a layout with ``context = n > 1`` the ``n`` ranks of a context group
read the same batch, and each keeps only its part of every sequence.
Attention is causal, so a token late in the sequence attends to more keys
than an early one: cutting the sequence into ``n`` runs would give the last
rank ``2n - 1`` times the first one's work. PyTorch (``context_parallel``'s
head-tail load balancer) and torchtitan instead cut it into ``2n`` equal
chunks and give rank ``r`` chunks ``r`` and ``2n - 1 - r``, head first: every
rank then holds the same number of tokens *and* the same causal work
(``sum(position + 1)`` over its tokens). The functions here make exactly
those slices, so a batch sliced here lines up with the buffers torch's
``context_parallel`` shards.

Slice the labels *after* shifting them over the whole sequence (the target
of the token at position ``p`` is the token at ``p + 1``, which may sit in
another rank's chunk), and pass the positions of :func:`context_positions`
to the model (its rotary or learned position embedding must see the
original positions, not ``0 .. length / n``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from faccel._tree import tree_map
from faccel.errors import ArgumentError, ArgumentValueError

__all__ = ["context_positions", "context_shard", "context_unshard"]


def _check(length: int, rank: int, ranks: int) -> int:
    """The chunk length, after refusing what has no head-tail split."""
    for name, value, low in (("ranks", ranks, 1), ("length", length, 0)):
        if type(value) is not int or value < low:
            msg = f"{name} must be an int >= {low}, got {value!r}"
            raise ArgumentValueError(msg)
    if type(rank) is not int or not 0 <= rank < ranks:
        msg = f"rank must be an int in [0, {ranks}) (the context coordinate), got {rank!r}"
        raise ArgumentValueError(msg)
    if length % (2 * ranks):
        msg = (
            f"a sequence of {length} tokens cannot be cut into 2 x {ranks} equal chunks for {ranks} "
            f"context ranks; pad every sequence to a multiple of {2 * ranks} (torch's "
            "context_parallel needs the same)"
        )
        raise ArgumentValueError(msg)
    return length // (2 * ranks)


def context_positions(length: int, *, rank: int, ranks: int) -> torch.Tensor:
    """The positions (in the whole sequence) of the tokens context rank ``rank`` of ``ranks`` holds, in order.

    Chunk ``rank`` and chunk ``2 * ranks - 1 - rank`` of ``2 * ranks`` equal
    chunks: the head-tail split of torch's ``context_parallel``.

    Args:
        length: Tokens in the whole sequence (a multiple of ``2 * ranks``).
        rank: This rank's context coordinate (``layout.coordinate("context", rank)``).
        ranks: The context size.

    Returns:
        A 1-D ``torch.long`` tensor of ``length // ranks`` positions.

    Raises:
        ArgumentValueError: ``length`` not a multiple of ``2 * ranks``, or a rank outside ``[0, ranks)``.

    Example:
        >>> [context_positions(8, rank=r, ranks=2).tolist() for r in range(2)]
        [[0, 1, 6, 7], [2, 3, 4, 5]]
    """
    chunk = _check(length, rank, ranks)
    head = torch.arange(rank * chunk, (rank + 1) * chunk)
    tail_start = (2 * ranks - 1 - rank) * chunk
    return torch.cat([head, torch.arange(tail_start, tail_start + chunk)])


def context_shard(batch: Any, *, rank: int, ranks: int, dim: int = 1) -> Any:
    """Each tensor of ``batch`` cut to context rank ``rank``'s head-tail slice along ``dim``.

    ``batch`` is a tensor or a tree of them (tuple, list, dict), every one with
    the same sequence length along ``dim`` (token ids, shifted labels, an
    attention mask...); other leaves are kept as they are. The inverse is
    :func:`context_unshard`.

    Args:
        batch: What the loader gave, already shifted (labels) over the whole sequence.
        rank: This rank's context coordinate.
        ranks: The context size (``layout.context``).
        dim: The sequence dimension (1 for ``(batch, sequence, ...)``).

    Returns:
        The same structure holding each rank's slices (copies, contiguous).

    Raises:
        ArgumentValueError: A sequence length that is not a multiple of ``2 * ranks``,
            or tensors of different lengths along ``dim``.

    Example:
        >>> ids = torch.arange(8).view(1, 8)
        >>> context_shard({"ids": ids, "labels": ids + 1}, rank=1, ranks=2)
        {'ids': tensor([[2, 3, 4, 5]]), 'labels': tensor([[3, 4, 5, 6]])}
    """
    lengths: set[int] = set()

    def length_of(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            lengths.add(leaf.shape[dim] if leaf.ndim > dim else -1)  # -1: no such dim
        return leaf

    tree_map(length_of, batch)
    if len(lengths) > 1 or -1 in lengths:
        msg = (
            f"context_shard cuts every tensor of the batch along dim {dim}, so they must share one "
            f"sequence length there; got lengths {sorted(str(n) for n in lengths)}"
        )
        raise ArgumentValueError(msg)
    if not lengths:
        return batch
    (length,) = lengths
    index = context_positions(length, rank=rank, ranks=ranks)

    def cut(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor):
            return leaf
        return leaf.index_select(dim, index.to(leaf.device))

    return tree_map(cut, batch)


def context_unshard(pieces: Sequence[torch.Tensor], *, dim: int = 1) -> torch.Tensor:
    """The whole sequences back from every context rank's slice (``pieces[r]`` from rank ``r``).

    The inverse of :func:`context_shard`: ``context_unshard([context_shard(x,
    rank=r, ranks=n) for r in range(n)]) == x``. Use it on what
    ``faccel.gather`` collected over the context group (logits, per-token losses).

    Raises:
        ArgumentError: ``pieces`` is not a non-empty sequence of tensors.
        ArgumentValueError: Pieces of different lengths along ``dim``, or of an odd length.

    Example:
        >>> x = torch.arange(12).view(1, 12)
        >>> pieces = [context_shard(x, rank=r, ranks=3) for r in range(3)]
        >>> bool(torch.equal(context_unshard(pieces), x))
        True
    """
    if not pieces or not all(isinstance(p, torch.Tensor) for p in pieces):
        msg = f"context_unshard needs every context rank's tensor, in rank order; got {pieces!r:.80}"
        raise ArgumentError(msg)
    sizes = {p.shape[dim] for p in pieces}
    if len(sizes) != 1 or next(iter(sizes)) % 2:
        msg = (
            f"each context rank holds two equal chunks of every sequence, so the pieces have one even "
            f"length along dim {dim}; got {[p.shape[dim] for p in pieces]}"
        )
        raise ArgumentValueError(msg)
    chunk = next(iter(sizes)) // 2
    heads = [p.narrow(dim, 0, chunk) for p in pieces]
    tails = [p.narrow(dim, chunk, chunk) for p in reversed(pieces)]
    return torch.cat([*heads, *tails], dim=dim)
