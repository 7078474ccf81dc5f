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
    dist: DistState, iterable: Iterable[T], *, total: int | None = None, **tqdm_kwargs: Any
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
        >>> other = faccel.DistState.simulated(rank=1, world_size=2)
        >>> faccel.progress(other, loader) is loader
        True
    """
    if not dist.is_main_process:
        return iterable
    from tqdm.auto import tqdm

    epoch_length, start = _position(iterable)
    if total is None:
        total = epoch_length
    tqdm_kwargs.setdefault("initial", start)
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
