"""A logger that knows its rank: ``[rank r/w]`` prefixes, main process only by default.

The adapter holds the ``DistState`` it was made for and nothing else: records
go to Python's own logger of that name, so handlers, levels and formats are
configured the usual way (``logging.basicConfig``...). faccel adds no handler.
"""

from __future__ import annotations

import builtins
import logging
import os
import sys
from collections.abc import Mapping, MutableMapping
from typing import Any

from faccel._dist._launch import rank_and_world
from faccel._dist._state import DistState
from faccel.errors import ArgumentError, LaunchError

__all__ = ["RankLogger", "get_logger", "print"]


class RankLogger(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A ``logging.LoggerAdapter`` that prefixes ``[rank r/w]`` and filters by rank.

    Every logging method (``debug``, ``info``, ``warning``, ``error``,
    ``exception``, ``log``...) takes one more keyword, ``main_process_only``:
    True logs on global rank 0 only, False on every rank; when omitted the
    logger's default (set by :func:`get_logger`) applies. Record attributes
    ``rank`` and ``world_size`` are added for formatters.

    Example:
        >>> import logging, sys, faccel
        >>> handler = logging.StreamHandler(sys.stdout)
        >>> logging.getLogger("demo.rank").addHandler(handler)
        >>> log = faccel.get_logger(faccel.DistState.simulated(rank=1, world_size=2), "demo.rank")
        >>> log.warning("only rank 0 prints this")
        >>> log.warning("every rank prints this", main_process_only=False)
        [rank 1/2] every rank prints this
        >>> logging.getLogger("demo.rank").removeHandler(handler)
    """

    def __init__(
        self, logger: logging.Logger, dist: DistState | None, *, main_process_only: bool = True
    ) -> None:
        super().__init__(logger, {})
        self.dist = dist
        self.main_process_only = main_process_only

    def _where(self) -> tuple[int, int]:
        # Without a DistState (a module-level logger), the process's rank is read at each call:
        # the running process group's, else the launcher's (faccel._dist._launch's table), else 0 of 1.
        if self.dist is not None:
            return self.dist.rank, self.dist.world_size
        import torch.distributed as torch_dist

        if torch_dist.is_available() and torch_dist.is_initialized():
            return torch_dist.get_rank(), torch_dist.get_world_size()
        try:  # through the launcher table: torchrun's RANK / WORLD_SIZE, SLURM's, Open MPI's
            return rank_and_world(os.environ)
        except LaunchError:  # a malformed launcher environment is detect()'s to report, not a log line's
            return 0, 1

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        """Prefix the rank and add ``rank`` and ``world_size`` to the record."""
        rank, world_size = self._where()
        extra: Mapping[str, Any] = kwargs.get("extra") or {}
        kwargs["extra"] = {"rank": rank, "world_size": world_size, **extra}
        return f"[rank {rank}/{world_size}] {msg}", kwargs

    def log(self, level: int, msg: Any, *args: Any, **kwargs: Any) -> None:
        """Log ``msg`` at ``level`` on the ranks that ``main_process_only`` selects."""
        only_main = kwargs.pop("main_process_only", None)
        if only_main is None:
            only_main = self.main_process_only
        if only_main and self._where()[0] != 0:
            return
        # One more frame (this method) between the caller and the logging module,
        # so %(filename)s and %(lineno)d name the user's line, not this one.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        super().log(level, msg, *args, **kwargs)


def get_logger(
    dist: DistState | str, name: str | None = None, *, main_process_only: bool = True
) -> RankLogger:
    """Python's logger ``name``, wrapped to prefix the rank and log on the main process.

    No handler is added and no level is set: configure logging as usual
    (``logging.basicConfig(level=logging.INFO)``); until then Python shows
    warnings and errors only.

    At module level, before any ``DistState`` exists, write
    ``logger = faccel.get_logger(__name__)``: that logger reads the process's
    rank at each call (the running process group's, else the launcher's
    ``RANK`` and ``WORLD_SIZE``, or SLURM's or Open MPI's, as ``detect``
    reads them), and keeps nothing but its name.

    Args:
        dist: The run's :class:`DistState` (its rank and world size), or the
            logger's name alone (``get_logger(__name__)``).
        name: The logger's name, usually ``__name__``.
        main_process_only: The default of each call's ``main_process_only``:
            log on global rank 0 only (True) or on every rank (False).

    Returns:
        A :class:`logging.LoggerAdapter` over ``logging.getLogger(name)``.

    Raises:
        ArgumentError: ``dist`` is neither a DistState nor a name, or a name is missing.

    Example:
        >>> import logging, sys, faccel
        >>> handler = logging.StreamHandler(sys.stdout)
        >>> logging.getLogger("demo.main").addHandler(handler)
        >>> log = faccel.get_logger(faccel.detect({}), "demo.main")
        >>> log.warning("loss %.2f", 0.5)
        [rank 0/1] loss 0.50
        >>> faccel.get_logger("demo.main").warning("no DistState needed")
        [rank 0/1] no DistState needed
        >>> logging.getLogger("demo.main").removeHandler(handler)
    """
    if isinstance(dist, str) and name is None:
        return RankLogger(logging.getLogger(dist), None, main_process_only=main_process_only)
    if not isinstance(dist, DistState) or not isinstance(name, str):
        msg = (
            f"get_logger takes (dist, name) or a name alone, got ({type(dist).__name__}, "
            f"{type(name).__name__}); call faccel.get_logger(dist, __name__) or faccel.get_logger(__name__)"
        )
        raise ArgumentError(msg)
    return RankLogger(logging.getLogger(name), dist, main_process_only=main_process_only)


def print(dist: DistState, *values: Any, main_process_only: bool = True, **kwargs: Any) -> None:
    """``print`` on the main process only (Accelerate's ``accelerator.print``).

    Unlike :func:`get_logger`, it needs no logging configuration: the values go
    to standard output as the builtin ``print`` formats them, in one ``write``
    (the builtin writes the text and its ``end`` apart, so under torchrun,
    whose workers run unbuffered into one pipe, two ranks' lines could merge).

    Args:
        dist: The run's :class:`DistState`.
        *values: What the builtin ``print`` takes.
        main_process_only: Print on global rank 0 only (True) or on every rank.
        **kwargs: The builtin's keywords (``sep``, ``end``, ``file``, ``flush``).

    Example:
        >>> import faccel
        >>> faccel.print(faccel.detect({}), "epoch", 3)
        epoch 3
        >>> faccel.print(faccel.DistState.simulated(rank=1, world_size=2), "not on rank 1")
    """
    if main_process_only and not dist.is_main_process:
        return
    unknown = set(kwargs) - {"sep", "end", "file", "flush"}
    if unknown:
        builtins.print(*values, **kwargs)  # the builtin's own TypeError names the keyword
        return
    sep, end = kwargs.get("sep"), kwargs.get("end")
    text = (" " if sep is None else sep).join(str(value) for value in values) + ("\n" if end is None else end)
    out = kwargs.get("file") or sys.stdout
    out.write(text)
    if kwargs.get("flush"):
        out.flush()
