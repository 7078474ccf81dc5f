"""An ``IterableDataset``'s stream dealt to one rank, as lists of samples, from a batch fixed when made."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import attrs
from torch.utils.data import IterableDataset, get_worker_info

from faccel._data._sharding import Sharding

__all__ = ["ShardedStream", "length_or_zero"]


class ShardedStream(IterableDataset):  # type: ignore[type-arg]
    """An IterableDataset's stream dealt to one rank, as lists of samples, from batch ``start``.

    Every rank reads the whole stream and keeps positions ``p`` with
    ``p % world_size == rank``, the same dealing as :class:`Sharding` without
    shuffling. A batch is released only once the whole round it belongs to has
    been read, so under ``drop_last`` every rank releases the same batches.
    At the end of the stream each rank knows the length and pads exactly as
    ``Sharding`` does, from the first samples of the stream.
    Loader workers split this rank's batches round-robin, which is the order
    the DataLoader collects them in. Each view of a prepared loader has its
    own stream (its ``start`` never changes), so two views never see each
    other's position.
    """

    def __init__(self, dataset: Iterable[Any], sharding: Sharding, start: int = 0) -> None:
        self.dataset = dataset
        self.sharding = sharding
        self.start = start

    def _batches(self) -> Iterator[list[Any]]:
        s = self.sharding
        w, b, r = s.world_size, s.batch_size, s.rank
        head: list[Any] = []
        batch: list[Any] = []
        count = 0
        for item in self.dataset:
            if count < w:
                head.append(item)
            if count % w == r:
                batch.append(item)
            count += 1
            if count % (w * b) == 0:  # a round is complete: every rank holds a full batch
                yield batch
                batch = []
        if s.drop_last or count == 0:
            return  # the incomplete last round is dropped on every rank alike
        if s.even_batches:
            # Positions [count, total) repeat the start of the stream; the first
            # that is ours is the next one congruent to r modulo w.
            total = attrs.evolve(s, num_samples=count).total
            first = count + (r - count) % w
            batch.extend(head[p % count] for p in range(first, total, w))
        if batch:
            yield batch

    def __iter__(self) -> Iterator[list[Any]]:
        worker = get_worker_info()
        workers, wid = (1, 0) if worker is None else (worker.num_workers, worker.id)
        for k, batch in enumerate(self._batches()):
            if k >= self.start and (k - self.start) % workers == wid:
                yield batch


def length_or_zero(dataset: object) -> int:
    """``len(dataset)``, or 0 for a stream without a length."""
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        return 0
