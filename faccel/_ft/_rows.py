"""Which samples each replica reads in a step of a changing quorum (pure).

The epoch's order is one permutation of the dataset, a function of ``(seed, epoch)``.
A step reads the next ``participants * batch_size`` positions of it (fewer at the
epoch's end), dealt to the replicas in contiguous blocks by their rank in the quorum;
the position moves on only when the step is committed. A discarded step's positions
are read again by the next quorum, so every sample of an epoch is in exactly one
committed step, whatever replicas came and went.
"""

from __future__ import annotations

import attrs
import torch

__all__ = ["ReplicaRows", "epoch_order", "replica_rows", "sample_counts"]

# Seeds of successive epochs: far apart so that (seed, epoch) never repeats a generator seed.
_EPOCH_STRIDE = 1 << 20
_SEED_MASK = (1 << 63) - 1


@attrs.frozen(kw_only=True)
class ReplicaRows:
    """One replica's share of a step: positions ``[start, stop)`` of ``epoch``'s order.

    Attributes:
        epoch: The epoch the positions belong to.
        start: The first position (of the epoch's order) this replica reads.
        stop: One past the last.
        taken: Positions the whole step reads (all replicas together); the position
            advances by this much when the step is committed.
    """

    epoch: int
    start: int
    stop: int
    taken: int


def epoch_order(seed: int, epoch: int, dataset_size: int) -> torch.Tensor:
    """The epoch's order of sample indices: a permutation drawn from ``(seed, epoch)`` alone.

    Example:
        >>> order = epoch_order(0, 1, 6)
        >>> sorted(order.tolist()), order.equal(epoch_order(0, 1, 6))
        ([0, 1, 2, 3, 4, 5], True)
    """
    generator = torch.Generator().manual_seed((seed * _EPOCH_STRIDE + epoch) & _SEED_MASK)
    return torch.randperm(dataset_size, generator=generator)


def sample_counts(*, consumed: int, dataset_size: int, batch_size: int, participants: int) -> list[int]:
    """How many samples each replica rank reads in the step (they differ only at an epoch's end).

    The step reads ``min(remaining, participants * batch_size)`` positions, split as
    evenly as possible, the lower ranks taking one more where it does not divide.

    Example:
        >>> sample_counts(consumed=0, dataset_size=100, batch_size=4, participants=3)
        [4, 4, 4]
        >>> sample_counts(consumed=95, dataset_size=100, batch_size=4, participants=3)
        [2, 2, 1]
    """
    taken = min(dataset_size - consumed, participants * batch_size)
    base, extra = divmod(taken, participants)
    return [base + (1 if rank < extra else 0) for rank in range(participants)]


def replica_rows(
    *, epoch: int, consumed: int, dataset_size: int, batch_size: int, replica_rank: int, participants: int
) -> ReplicaRows:
    """Replica ``replica_rank``'s positions of the step that starts at ``consumed``.

    Example:
        >>> [replica_rows(epoch=0, consumed=8, dataset_size=20, batch_size=4, replica_rank=r,
        ...               participants=2) for r in (0, 1)][1]
        ReplicaRows(epoch=0, start=12, stop=16, taken=8)
    """
    counts = sample_counts(
        consumed=consumed, dataset_size=dataset_size, batch_size=batch_size, participants=participants
    )
    start = consumed + sum(counts[:replica_rank])
    return ReplicaRows(epoch=epoch, start=start, stop=start + counts[replica_rank], taken=sum(counts))
