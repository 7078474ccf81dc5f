"""``stop_signal``: a preemption notice (SIGTERM, SIGUSR1) as a flag the loop reads at a step boundary.

The handlers only set a flag: nothing runs inside the signal handler, so a
signal that lands during a checkpoint's write (a second SIGTERM, say) changes
nothing on disk. The loop asks ``faccel.any_rank(dist, stop.received)`` once
in a while, so every rank takes the same decision at the same step, then
checkpoints and exits 0 (docs/preemption.md). The previous handlers come back
when the :class:`StopSignal` is closed (it is a context manager) or at
:func:`faccel.shutdown`.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import Any

from faccel._dist._runtime import Runtime
from faccel._dist._state import DistState
from faccel._typecheck import setup_checked
from faccel.errors import UsageError

__all__ = ["StopSignal", "stop_signal"]


class StopSignal:
    """Handlers that record a stop signal; read :attr:`received` at a step boundary.

    Not a record: the flag changes when a signal lands, which is its purpose.
    Made by :func:`stop_signal`; close it (or leave its ``with`` block, or call
    :func:`faccel.shutdown`) to put the previous handlers back.

    Example:
        >>> import signal, faccel
        >>> with faccel.stop_signal(faccel.detect({}), signals=(signal.SIGUSR2,)) as stop:
        ...     stop.received
        False
    """

    __slots__ = ("_previous", "_runtime", "_signals", "received_signal")

    def __init__(self, signals: Sequence[signal.Signals], runtime: Runtime) -> None:
        self._signals = tuple(signals)
        self._runtime = runtime  # whose close (at shutdown) restores the handlers
        self._previous: dict[signal.Signals, Any] = {}
        #: The number of the first signal received, None until one lands.
        self.received_signal: int | None = None

    @property
    def received(self) -> bool:
        """Whether one of the signals has landed in this process since it was installed."""
        return self.received_signal is not None

    def _handle(self, number: int, _frame: FrameType | None) -> None:
        # Only a flag: a handler that wrote files or raised could cut a checkpoint in half.
        if self.received_signal is None:
            self.received_signal = number

    def _install(self) -> None:
        for number in self._signals:
            self._previous[number] = signal.signal(number, self._handle)

    def close(self) -> None:
        """Put back the handlers that were there before. Safe to call more than once."""
        while self._previous:
            number, previous = self._previous.popitem()
            signal.signal(number, previous)
        self._runtime.drop_hook(self._hook_name)

    @property
    def _hook_name(self) -> str:
        return f"stop_signal/{id(self)}"

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


@setup_checked
def stop_signal(
    dist: DistState, *, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1)
) -> StopSignal:
    """Install handlers that note a stop signal instead of ending the process.

    Read ``faccel.any_rank(dist, stop.received)`` at a step boundary: it is
    true on every rank at the same step whether one rank got the signal (a
    SIGTERM to one worker) or all did (SIGTERM to torchrun's agent, which
    forwards it; SLURM's ``--signal``). Then checkpoint and exit 0.

    Args:
        dist: The run's :class:`DistState`; :func:`faccel.shutdown` of it
            restores the previous handlers.
        signals: The signals to catch (SIGTERM and SIGUSR1 by default).

    Returns:
        A :class:`StopSignal`; a context manager that restores the previous
        handlers when it closes.

    Raises:
        UsageError: Called outside the main thread (Python installs signal
            handlers in the main thread only).

    Example:
        >>> import os, signal, faccel
        >>> dist = faccel.detect({})
        >>> with faccel.stop_signal(dist) as stop:
        ...     os.kill(os.getpid(), signal.SIGUSR1)
        ...     faccel.any_rank(dist, stop.received)
        True
        >>> signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
        True
    """
    if threading.current_thread() is not threading.main_thread():
        msg = (
            "stop_signal() must be called from the main thread, got a call from thread "
            f"{threading.current_thread().name!r}; Python installs signal handlers in the main "
            "thread only: call it before starting threads"
        )
        raise UsageError(msg)
    stop = StopSignal(signals, dist.runtime)
    stop._install()
    dist.runtime.at_close(stop._hook_name, stop.close)
    return stop
