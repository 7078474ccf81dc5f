"""A progress bar on the main process, the iterable itself everywhere else.

tqdm is imported on first use, on the main process only, so ``import faccel``
and the other ranks never pay for it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from faccel._data._loader import PreparedLoader
from faccel._dist._state import DistState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError

__all__ = ["progress"]

T = TypeVar("T")


def _position(iterable: object) -> tuple[int | None, int]:
    """(batches in the whole epoch, batches already consumed) of a prepared loader."""
    if not isinstance(iterable, PreparedLoader):
        return None, 0
    try:
        return len(iterable), iterable.start
    except TypeError:  # an IterableDataset without __len__: the epoch's length is unknown
        return None, iterable.start


@setup_checked
def progress(
    dist: DistState,
    iterable: Iterable[T],
    *,
    total: int | None = None,
    items_per_batch: int | None = None,
    **tqdm_kwargs: Any,
) -> Iterable[T]:
    """Show a tqdm progress bar over ``iterable`` on the main process only.

    On other ranks ``iterable`` itself is returned: no bar, no cost per item.
    A :class:`PreparedLoader` view that resumes at batch ``start`` yields
    ``len(loader) - start`` batches; its bar starts at ``start`` of
    ``len(loader)``, so a resumed epoch ends at 100% like an uninterrupted one.
    The bar keeps the loader's ``start`` and length, so
    ``faccel.micro_batches(dist, faccel.progress(dist, loader))`` places the
    accumulation boundaries on the main process where the other ranks do.

    Args:
        dist: The run's :class:`DistState`.
        iterable: What to iterate, usually a prepared loader.
        total: Items in the whole bar; by default the loader's batches per
            epoch, or ``len(iterable)`` when it has one.
        items_per_batch: The items (samples, or tokens) a batch holds on this
            rank: the bar then counts items, and shows items/s and the time left
            (the ETA) in them. By default it counts batches (it/s).
        **tqdm_kwargs: Passed to ``tqdm.tqdm`` (``desc``, ``unit``, ``initial``,
            ``file``, ``disable``...).

    Returns:
        A ``tqdm`` iterator on the main process, ``iterable`` elsewhere.

    Example:
        >>> import io, torch, faccel
        >>> data = torch.utils.data.TensorDataset(torch.arange(8))
        >>> loader = faccel.prepare(faccel.detect({}), torch.utils.data.DataLoader(data, batch_size=2))
        >>> bar = io.StringIO()
        >>> [b.tolist() for (b,) in faccel.progress(faccel.detect({}), loader.at(epoch=0, start=2), file=bar)]
        [[4, 5], [6, 7]]
        >>> "4/4" in bar.getvalue()         # resumed at batch 2 of 4, finished at 4 of 4
        True
        >>> bar = io.StringIO()
        >>> _ = list(faccel.progress(faccel.detect({}), loader, items_per_batch=2, file=bar))
        >>> "8/8" in bar.getvalue() and "item/s" in bar.getvalue()    # 4 batches of 2 items
        True
        >>> other = faccel.DistState.simulated(rank=1, world_size=2)
        >>> faccel.progress(other, loader) is loader
        True
    """
    if items_per_batch is not None and items_per_batch < 1:  # refused on every rank alike
        msg = f"progress: items_per_batch must be >= 1 (the items a batch holds), got {items_per_batch}"
        raise ArgumentValueError(msg)
    if not dist.is_main_process:
        return iterable
    from tqdm.auto import tqdm

    epoch_length, start = _position(iterable)
    if total is None:
        total = epoch_length
    tqdm_kwargs.setdefault("initial", start)
    if items_per_batch is not None:
        # tqdm shows n, total and the rate times unit_scale: items, and items/s; the ETA is the same time.
        tqdm_kwargs.setdefault("unit", "item")
        tqdm_kwargs.setdefault("unit_scale", items_per_batch)
    # A loader is handed over as one iterator: tqdm.auto calls iter() on what it gets and
    # then iterates it again, which would start a loader's workers twice (and iterate a
    # bare loader twice, which faccel refuses).
    source = iter(iterable) if isinstance(iterable, PreparedLoader) else iterable
    bar = tqdm(source, total=total, **tqdm_kwargs)
    if isinstance(iterable, PreparedLoader):
        # The other ranks get the loader itself; consumers that read its position
        # (faccel.micro_batches reads `start` and len()) must see the same one here,
        # or rank 0 would place accumulation boundaries elsewhere and DDP would hang.
        bar.start = start
    return bar  # type: ignore[no-any-return]
