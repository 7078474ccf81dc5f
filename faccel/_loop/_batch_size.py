"""The largest batch size that fits: retry a function on out-of-memory with a smaller one.

Accelerate's ``find_executable_batch_size`` with its name and shrink rule
(``int(batch_size * 0.9)`` after each out-of-memory error), and two changes
that fit faccel: the ranks agree on every try (one ``any_rank`` after it, so a
rank that ran out of memory makes every rank retry at the same smaller size
instead of leaving them at different sizes), and each call starts from
``starting_batch_size`` (nothing is remembered between calls).
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from faccel._dist._collectives import any_rank
from faccel._dist._state import DistState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentError, ArgumentValueError, BatchSizeError

__all__ = ["find_executable_batch_size", "is_out_of_memory"]

T = TypeVar("T")

# The messages of allocators' errors that are not torch.OutOfMemoryError (Accelerate's list).
_OOM_MESSAGES = (
    " out of memory.",
    "MPS backend out of memory",
    "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
    "DefaultCPUAllocator: can't allocate memory",
    "FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed",
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's out-of-memory error (what a smaller batch may cure).

    Example:
        >>> is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory.")), is_out_of_memory(ValueError())
        (True, False)
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return (
        isinstance(error, RuntimeError)
        and len(error.args) == 1
        and isinstance(error.args[0], str)
        and any(text in error.args[0] for text in _OOM_MESSAGES)
    )


def _free_cache() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@setup_checked
def find_executable_batch_size(
    dist: DistState,
    function: Callable[..., T] | None = None,
    *,
    starting_batch_size: int = 128,
    shrink: float = 0.9,
) -> Any:
    """Call ``function(batch_size, ...)``, shrinking ``batch_size`` after each out-of-memory error.

    A decorator, as Accelerate's (``@find_executable_batch_size(dist,
    starting_batch_size=128)`` over ``def train(batch_size, ...)``, then
    ``train(...)`` without the batch size). After an out-of-memory error
    (``torch.OutOfMemoryError``, or a ``RuntimeError`` with an allocator's
    out-of-memory message) the device cache is freed and the next try runs at
    ``int(batch_size * shrink)``. With several processes every try ends with
    one ``any_rank``: when any rank ran out of memory, every rank retries at the
    same smaller size (the function must be safe to run again: build the
    loader, model and optimizer inside it). Other errors propagate at once.

    Args:
        dist: The run's :class:`DistState`.
        function: The function to wrap (or None, to use as ``@decorator(dist, ...)``).
        starting_batch_size: The first batch size tried.
        shrink: The factor each failure multiplies the batch size by, in (0, 1).

    Returns:
        The wrapped function (or a decorator, when ``function`` is None); it
        returns what ``function`` returns at the first batch size that fits.

    Raises:
        ArgumentValueError: ``starting_batch_size`` < 1, or ``shrink`` not in (0, 1).
        BatchSizeError: (from the wrapped function) every size down to 1 ran out of memory.
        ArgumentError: (from the wrapped function) ``batch_size`` passed to it by keyword.

    Example:
        >>> import torch, faccel
        >>> @faccel.find_executable_batch_size(faccel.detect({}), starting_batch_size=100)
        ... def train(batch_size):
        ...     if batch_size > 60:
        ...         raise torch.OutOfMemoryError("CUDA out of memory.")
        ...     return batch_size
        >>> train()  # 100, 90, 81, 72, 64, 57
        57
    """
    if type(starting_batch_size) is not int or starting_batch_size < 1:
        msg = f"starting_batch_size must be an int >= 1, got {starting_batch_size!r}"
        raise ArgumentValueError(msg)
    if not 0.0 < shrink < 1.0:
        msg = f"shrink must be in (0, 1) (Accelerate's rule is 0.9), got {shrink!r}"
        raise ArgumentValueError(msg)
    if function is None:
        return functools.partial(
            find_executable_batch_size, dist, starting_batch_size=starting_batch_size, shrink=shrink
        )
    wrapped = function

    @functools.wraps(wrapped)
    def tries(*args: Any, **kwargs: Any) -> T:
        if "batch_size" in kwargs:
            msg = (
                f"{wrapped.__name__}(batch_size={kwargs['batch_size']!r}): find_executable_batch_size "
                f"passes the batch size itself (from {starting_batch_size} down); call "
                f"{wrapped.__name__}(...) without it, and pass starting_batch_size= to the decorator"
            )
            raise ArgumentError(msg)
        batch_size = starting_batch_size
        tried = []
        while batch_size >= 1:
            tried.append(batch_size)
            _free_cache()
            failed = False
            result: Any = None
            try:
                result = wrapped(batch_size, *args, **kwargs)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                failed = True  # leaving the except block drops the error and the frames it holds
            if not any_rank(dist, failed):
                return result
            result = None
            batch_size = int(batch_size * shrink)
        _free_cache()
        msg = (
            f"no batch size fits: {wrapped.__name__} ran out of memory at every size tried "
            f"({', '.join(map(str, tried))}); use a smaller model or sequence, another precision, "
            "sharding (strategy='fsdp'), or a larger device"
        )
        raise BatchSizeError(msg)

    return tries
