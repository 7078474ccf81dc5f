"""stop_signal: handlers that only set a flag, restored on close and at shutdown."""

from __future__ import annotations

import os
import signal
import threading

import pytest


def test_a_signal_sets_the_flag_and_closing_restores_the_previous_handlers() -> None:
    import faccel

    dist = faccel.detect({})
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda number, _: seen.append(number))
    try:
        before = signal.getsignal(signal.SIGUSR1)
        with faccel.stop_signal(dist, signals=(signal.SIGUSR1,)) as stop:
            assert not stop.received and not faccel.any_rank(dist, stop.received)
            os.kill(os.getpid(), signal.SIGUSR1)
            os.kill(os.getpid(), signal.SIGUSR1)  # a second one changes nothing
            assert stop.received and stop.received_signal == signal.SIGUSR1
            assert faccel.any_rank(dist, stop.received)
        assert signal.getsignal(signal.SIGUSR1) is before and seen == []
        stop.close()  # twice is fine
    finally:
        signal.signal(signal.SIGUSR1, previous)


def test_shutdown_restores_the_handlers() -> None:
    import faccel

    dist = faccel.detect({})
    before = signal.getsignal(signal.SIGTERM)
    stop = faccel.stop_signal(dist)
    assert signal.getsignal(signal.SIGTERM) is not before
    faccel.shutdown(dist)
    assert signal.getsignal(signal.SIGTERM) is before
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    assert not stop.received


def test_outside_the_main_thread_is_a_usage_error() -> None:
    import faccel

    errors: list[BaseException] = []

    def install() -> None:
        try:
            faccel.stop_signal(faccel.detect({}))
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=install)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], faccel.errors.UsageError)
    with pytest.raises(faccel.errors.UsageError, match="must be called from the main thread"):
        raise errors[0]
