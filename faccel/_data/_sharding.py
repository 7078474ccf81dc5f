"""Which samples each rank sees: a pure function of a few integers.

The global order of an epoch is ``torch.randperm(n)`` seeded with
``seed + epoch`` (or ``range(n)`` without shuffling), exactly as
``torch.utils.data.DistributedSampler`` draws it. Positions in that order are
dealt round-robin: position ``p`` goes to rank ``p % world_size``. Each rank
cuts its positions into batches of ``batch_size``.

* ``drop_last``: only complete rounds of ``world_size * batch_size`` samples
  are used, so every rank gets the same number of full batches.
* ``even_batches`` (without ``drop_last``): the order is extended by wrapping
  around to its start, by the fewest samples that give every rank the same
  number of batches. Those repeated samples are the *padding*, reported by
  :attr:`Sharding.padding` and :meth:`Sharding.is_padding`.
* neither: no sample is repeated; ranks may differ by one batch.

With a ``sampler`` (any ``Sampler`` the loader had), the epoch's order is that
sampler's output for ``(seed, epoch)`` (see ``faccel._data._samplers``) instead of
``randperm``; it is dealt the same way. With ``whole_batches`` the sampler is a
batch sampler: the positions are its *batches*, each dealt whole to one rank
(``batch_size`` is then 1: one batch sampler batch per loader batch), and the
padding repeats whole batches.
Resuming at another world size: ``consumed`` global positions of the epoch's
order (read by all ranks together, see :meth:`Sharding.consumed_after`) are
skipped, and the rest of the order is dealt afresh to this world, the rules
above applied to the remainder. Positions stay global (position ``p`` is
``order[p % num_samples]``), so padding repeats the start of the epoch's order,
as it would have without the interruption. ``consumed=0`` is the plain epoch.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from faccel._data._samplers import draw
from faccel.errors import ArgumentValueError, UsageError

__all__ = ["Sharding"]


def _non_negative(_: object, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
    if value < 0:
        msg = f"{attribute.name} must be >= 0, got {value!r}"
        raise ArgumentValueError(msg)


def _positive(_: object, attribute: attrs.Attribute, value: int) -> None:  # type: ignore[type-arg]
    if value < 1:
        msg = f"{attribute.name} must be >= 1, got {value!r}"
        raise ArgumentValueError(msg)


@attrs.frozen(kw_only=True)
class Sharding:
    """How one rank's share of a dataset is drawn, epoch by epoch.

    Every method is a pure function of the fields and its arguments.

    Raises:
        ArgumentValueError: ``num_samples`` or ``rank`` is negative,
            ``batch_size`` or ``world_size`` is below 1, ``rank`` is not below
            ``world_size``, ``consumed`` is negative or above ``num_samples``,
            :meth:`batches` gets a negative ``start``, or ``whole_batches``
            comes without a ``sampler`` or with ``batch_size`` > 1.
        UsageError: The ``sampler`` yields another count than ``num_samples``.

    Example:
        >>> s = Sharding(num_samples=7, batch_size=2, rank=2, world_size=3)
        >>> s.batches(epoch=0)          # position 8 wraps around to sample 1
        [[2, 5], [1]]
        >>> (s.num_batches, s.padding, s.is_padding(8))
        (2, 2, True)

        A batch sampler's batches, dealt whole (5 batches, 2 ranks: batch 0 pads rank 1):

        >>> buckets = [[0, 1, 2], [3, 4], [5], [6, 7], [8]]
        >>> s = Sharding(num_samples=5, batch_size=1, rank=1, world_size=2,
        ...              sampler=buckets, whole_batches=True)
        >>> s.batches(epoch=0), s.padding
        ([[3, 4], [6, 7], [0, 1, 2]], 1)

        Two ranks read one batch each (4 positions), then the rest is dealt to three:

        >>> Sharding(num_samples=7, batch_size=2, world_size=2).consumed_after(1)
        4
        >>> [Sharding(num_samples=7, batch_size=2, rank=r, world_size=3, consumed=4).batches()
        ...  for r in range(3)]
        [[[4]], [[5]], [[6]]]
    """

    num_samples: int = attrs.field(validator=_non_negative)
    batch_size: int = attrs.field(validator=_positive)
    rank: int = attrs.field(default=0, validator=_non_negative)
    world_size: int = attrs.field(default=1, validator=_positive)
    shuffle: bool = False
    drop_last: bool = False
    even_batches: bool = True
    seed: int = 0
    # The loader's own sampler (or batch sampler, with whole_batches) when it is not a plain
    # sequential or shuffled one; num_samples is then the length of its output.
    sampler: object = None
    whole_batches: bool = False
    # Global positions of the epoch's order consumed before this sharding deals (a resume
    # at another world size); the remainder is dealt as a whole epoch would be.
    consumed: int = attrs.field(default=0, validator=_non_negative)

    def __attrs_post_init__(self) -> None:
        if self.rank >= self.world_size:
            msg = f"rank must be in [0, {self.world_size}), got {self.rank!r}"
            raise ArgumentValueError(msg)
        if self.whole_batches and (self.sampler is None or self.batch_size != 1):
            msg = (
                "whole_batches deals a batch sampler's batches whole: give sampler= (the batch "
                f"sampler) and batch_size=1, got sampler={self.sampler!r}, batch_size={self.batch_size}"
            )
            raise ArgumentValueError(msg)
        if self.consumed > self.num_samples:
            msg = f"consumed must be in [0, num_samples={self.num_samples}], got {self.consumed!r}"
            raise ArgumentValueError(msg)

    @property
    def total(self) -> int:
        """Where the dealt positions end (exclusive): all of an epoch's, padding included.

        Without ``consumed`` it is the number of positions dealt; with it, they
        are positions ``consumed`` up to ``total``.
        """
        o, w, b = self.consumed, self.world_size, self.batch_size
        n = self.num_samples - o  # what is left to deal
        if self.drop_last:
            return o + (n // (w * b)) * w * b
        if not self.even_batches or n == 0:
            return o + n
        rounds = -(-n // (w * b))
        # The last rank must reach one sample into the last batch: w * ((rounds-1)*b + 1).
        return o + max(n, w * ((rounds - 1) * b + 1))

    @property
    def padding(self) -> int:
        """Repeated samples added so every rank has the same number of batches."""
        return max(0, self.total - self.num_samples)

    def _count(self, rank: int) -> int:
        return max(0, -(-(self.total - self.consumed - rank) // self.world_size))

    @property
    def num_samples_on_rank(self) -> int:
        """Samples this rank sees in an epoch, padding included."""
        return self._count(self.rank)

    @property
    def num_batches(self) -> int:
        """Batches this rank sees in an epoch."""
        return -(-self._count(self.rank) // self.batch_size)

    def _drawn(self, epoch: int) -> list[Any]:
        """The sampler's output for ``epoch``: indices, or batches with ``whole_batches``."""
        drawn = draw(self.sampler, self.seed, epoch, batches=self.whole_batches)
        if len(drawn) != self.num_samples:
            what = "batches" if self.whole_batches else "indices"
            msg = (
                f"the {type(self.sampler).__name__} yielded {len(drawn)} {what} in epoch {epoch}, but "
                f"{self.num_samples} when the loader was prepared; the padding and every rank's share "
                "are computed from that count, so a sampler must yield the same number every epoch"
            )
            raise UsageError(msg)
        return drawn

    def order(self, epoch: int = 0) -> torch.Tensor:
        """The global order of dataset indices in ``epoch`` (before dealing).

        With ``whole_batches``: the batches' indices one after the other.
        """
        if self.sampler is not None:
            drawn = self._drawn(epoch)
            if self.whole_batches:
                drawn = [i for batch in drawn for i in batch]
            return torch.tensor(drawn, dtype=torch.long)
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def positions(self, rank: int | None = None) -> torch.Tensor:
        """Global positions dealt to ``rank`` (this rank by default), in order."""
        r = self.consumed + (self.rank if rank is None else rank)
        return torch.arange(r, max(r, self.total), self.world_size)

    def is_padding(self, position: int) -> bool:
        """Whether a global position repeats a sample (and should not be counted)."""
        return position >= self.num_samples

    def indices(self, epoch: int = 0) -> list[int]:
        """Dataset indices this rank sees in ``epoch``, padding included."""
        if self.num_samples == 0:
            return []
        if self.whole_batches:
            return [i for batch in self.batches(epoch) for i in batch]
        positions = self.positions()
        return self.order(epoch)[positions % self.num_samples].tolist()

    def batches(self, epoch: int = 0, start: int = 0) -> list[list[int]]:
        """This rank's batches of dataset indices in ``epoch``, from batch ``start`` on."""
        if start < 0:
            msg = f"start must be >= 0, got {start!r}"
            raise ArgumentValueError(msg)
        b = self.batch_size
        if self.num_samples == 0 or start >= self.num_batches:
            return []
        positions = self.positions()[start * b :]
        if self.whole_batches:
            units = self._drawn(epoch)
            return [units[p % self.num_samples] for p in positions.tolist()]
        flat = self.order(epoch)[positions % self.num_samples].tolist()
        return [flat[i : i + b] for i in range(0, len(flat), b)]

    def consumed_after(self, start: int) -> int:
        """Global positions of the epoch's order read once every rank has read ``start`` batches.

        Counted from the epoch's start (``consumed`` included) and capped at
        ``num_samples``: padding is never counted, and once rank 0 has read all
        its batches the whole epoch is consumed (under ``drop_last`` the dropped
        tail too). This is the position :meth:`batches` of any world size
        resumes from with ``consumed=``.

        Raises:
            ArgumentValueError: ``start`` is negative.

        Example:
            >>> s = Sharding(num_samples=10, batch_size=2, world_size=3)
            >>> [s.consumed_after(k) for k in range(3)]
            [0, 6, 10]
        """
        if start < 0:
            msg = f"start must be >= 0, got {start!r}"
            raise ArgumentValueError(msg)
        if start > 0 and start >= self._batches_of(0):
            return self.num_samples
        return min(self.consumed + start * self.world_size * self.batch_size, self.num_samples)

    def _batches_of(self, rank: int) -> int:
        return -(-self._count(rank) // self.batch_size)
