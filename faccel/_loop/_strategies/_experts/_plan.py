"""The dispatch plan of one mixture-of-experts layer on one rank: which rows go where, and back. Pure.

A layer routes each of its ``T`` tokens to ``k`` experts (``top_k_index``,
``[T, k]``): ``T * k`` *assignments*, numbered in row-major order (token, then
slot). Under expert parallelism the ``E`` experts are split over the ``R``
ranks of an expert group in contiguous blocks (rank ``r`` holds experts
``r * E / R`` to ``(r + 1) * E / R - 1``), so an assignment goes to the rank
of its expert. The plan of a rank is a few integer tensors:

- :func:`dispatch_plan` (sender): ``order``, the assignments sorted by expert,
  then slot, then token (the order transformers' own loop gathers an expert's
  rows in), ``counts`` per expert (``cells`` per expert and slot) and
  ``send_splits`` per rank; with a capacity, the assignments past an
  expert's capacity are dropped (``kept``), counted, and come back as zeros.
- :func:`receive_plan` (receiver): the rows arrive grouped by source rank,
  then by expert and slot; ``order`` groups them by expert, slot, then source
  rank (the order one process would see: every rank's tokens in rank order), and
  ``expert_counts`` says how many rows each local expert gets.

Both are permutations, and :func:`inverse` undoes them: every assignment is
sent once and comes back to its own place (tests/test_experts.py states the
laws for any routing, any ``E`` and ``R``). Nothing here communicates;
``faccel._loop._strategies._experts._dispatch`` runs the all-to-alls the plan sizes.
"""

from __future__ import annotations

import math

import attrs
import torch

from faccel.errors import ArgumentValueError

__all__ = ["DispatchPlan", "ReceivePlan", "capacity_of", "dispatch_plan", "inverse", "receive_plan"]


@attrs.frozen(kw_only=True)
class DispatchPlan:
    """What one rank sends: the assignments in expert order, per expert and per rank.

    Attributes:
        order: Indices of the kept assignments (into the flattened ``[T * k]``), by expert,
            then slot, then token.
        cells: Kept assignments per expert and slot, ``[E, k]`` (int64): what the receivers need.
        counts: Kept assignments per expert, ``[E]``.
        routed: Assignments routed to each expert before any drop, ``[E]``.
        send_splits: Rows sent to each rank of the expert group (sums of ``counts`` by block).
        dropped: Assignments past an expert's capacity, dropped (0 when dropless).
    """

    order: torch.Tensor
    cells: torch.Tensor
    counts: torch.Tensor
    routed: torch.Tensor
    send_splits: list[int]
    dropped: int


@attrs.frozen(kw_only=True)
class ReceivePlan:
    """What one rank received: its rows regrouped by local expert, then by source rank.

    Attributes:
        order: Into the received rows (grouped by source, then expert): the rows by expert, then source.
        experts: The local expert of each row in ``order``'s order (``[0, E / R)``, nondecreasing).
        per_expert: Rows each local expert gets, ``[E / R]``.
        recv_splits: Rows received from each source rank.
    """

    order: torch.Tensor
    experts: torch.Tensor
    per_expert: torch.Tensor
    recv_splits: list[int]

    @property
    def expert_counts(self) -> list[int]:
        """Rows each local expert gets, as a list."""
        return self.per_expert.tolist()  # type: ignore[no-any-return]


def _check(num_experts: int, ranks: int) -> None:
    if ranks < 1 or num_experts < 1 or num_experts % ranks:
        msg = (
            f"the {num_experts} experts of a layer are split over the {ranks} ranks of an expert group "
            "in equal blocks, so the group's size must divide the number of experts; choose "
            f"Layout(expert=...) among {[d for d in range(1, num_experts + 1) if num_experts % d == 0]}"
        )
        raise ArgumentValueError(msg)


def capacity_of(tokens: int, top_k: int, num_experts: int, factor: float | None) -> int | None:
    """Assignments an expert takes from one rank's batch: ``ceil(factor * T * k / E)``; None: dropless.

    Example:
        >>> capacity_of(10, 2, 8, 1.0), capacity_of(10, 2, 8, 1.25), capacity_of(10, 2, 8, None)
        (3, 4, None)
    """
    if factor is None:
        return None
    return math.ceil(factor * tokens * top_k / num_experts)


def dispatch_plan(
    top_k_index: torch.Tensor,
    *,
    num_experts: int,
    ranks: int,
    capacity: int | None = None,
    slot_major: bool = True,
) -> DispatchPlan:
    """The sender's plan for ``top_k_index`` (``[T, k]`` expert ids) over ``ranks`` expert ranks.

    Each expert's rows are its assignments by slot, then token (every first
    choice before any second choice): the order transformers' eager loop over
    experts gathers them in (``torch.where`` over the ``[k, T]`` mask), so the
    expert's weight gradient sums the same rows in the same order; with
    ``slot_major=False``, by token, then slot (the order of its ``grouped_mm``
    and ``batched_mm`` forwards, a sort of the flattened ids).

    Args:
        top_k_index: Each token's experts, ``[T, k]``, integers in ``[0, num_experts)``.
        num_experts: Experts in the layer (divisible by ``ranks``).
        ranks: The expert group's size.
        capacity: Assignments each expert keeps, in its rows' order; None keeps all (dropless).
        slot_major: The order of each expert's rows: by slot, then token (default), or by token.

    Raises:
        ArgumentValueError: ``ranks`` does not divide ``num_experts``.

    Example:
        >>> plan = dispatch_plan(torch.tensor([[1, 2], [0, 1]]), num_experts=4, ranks=2)
        >>> plan.order.tolist(), plan.counts.tolist(), plan.send_splits
        ([2, 0, 3, 1], [1, 2, 1, 0], [3, 1])
        >>> plan.cells.tolist()  # by expert and slot
        [[1, 0], [1, 1], [0, 1], [0, 0]]
    """
    _check(num_experts, ranks)
    tokens_k = top_k_index.shape[-1] if top_k_index.dim() == 2 else 1
    flat = top_k_index.reshape(-1).to(torch.int64)
    slot = torch.arange(flat.numel(), device=flat.device) % tokens_k
    key = flat * tokens_k + slot
    order = torch.sort(key if slot_major else flat, stable=True).indices
    cells = torch.bincount(key, minlength=num_experts * tokens_k).view(num_experts, tokens_k)
    routed = cells.sum(dim=1)
    dropped = 0
    if capacity is not None:
        # each assignment's place in its expert's queue: those at capacity or later are dropped
        starts = torch.cumsum(routed, 0) - routed
        place = torch.arange(order.numel(), device=flat.device) - starts[flat[order]]
        keep = place < capacity
        order = order[keep]
        kept_key = key[order]
        cells = torch.bincount(kept_key, minlength=num_experts * tokens_k).view(num_experts, tokens_k)
        dropped = int(routed.sum() - cells.sum())
    counts = routed if capacity is None else cells.sum(dim=1)
    send_splits = counts.view(ranks, num_experts // ranks).sum(dim=1).tolist()
    return DispatchPlan(
        order=order, cells=cells, counts=counts, routed=routed, send_splits=send_splits, dropped=dropped
    )


def receive_plan(cells_in: torch.Tensor, *, slot_major: bool = True) -> ReceivePlan:
    """The receiver's plan from each source's counts for this rank's experts (``[R, E / R, k]``).

    Rows arrive by source, each source's by local expert, then slot; ``order``
    lists them by local expert, then slot, then source, so an expert sees its
    rows in the order one process holding every rank's batch (in rank order)
    would give them (``slot_major=False``: by local expert, then source, each
    source's rows in the sender's token order).

    Example:
        >>> plan = receive_plan(torch.tensor([[[1], [2]], [[0], [1]]]))
        >>> plan.order.tolist(), plan.expert_counts, plan.recv_splits, plan.experts.tolist()
        ([0, 1, 2, 3], [1, 3], [3, 1], [0, 1, 1, 1])
        >>> receive_plan(torch.tensor([[[1, 1]], [[1, 1]]])).order.tolist()  # slot before source
        [0, 2, 1, 3]
    """
    cells = cells_in.to(torch.int64)
    ranks, local, top_k = cells.shape
    # (expert, slot) of each received row, in arrival order (source-major)
    key = torch.arange(local * top_k, device=cells.device).repeat(ranks).repeat_interleave(cells.reshape(-1))
    # sorted by (expert, slot) or by expert alone: the sorted keys name each row's expert
    ordered, order = torch.sort(key if slot_major else key // top_k, stable=True)
    return ReceivePlan(
        order=order,
        experts=ordered // top_k if slot_major else ordered,
        per_expert=cells.sum(dim=(0, 2)),
        recv_splits=cells.sum(dim=(1, 2)).tolist(),
    )


def inverse(order: torch.Tensor) -> torch.Tensor:
    """The permutation that undoes ``order``: ``x[order][inverse(order)] == x``.

    Example:
        >>> inverse(torch.tensor([2, 0, 1])).tolist()
        [1, 2, 0]
    """
    out = torch.empty_like(order)
    out[order] = torch.arange(order.numel(), dtype=order.dtype)
    return out
