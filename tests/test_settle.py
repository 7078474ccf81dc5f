"""settle_gloo_workers waits, without the interpreter lock, until the named worker threads sleep.

The real-process half is tests/distributed/test_exit.py (jobs whose last act is a collective);
here a thread named like a worker runs without the lock (hashing, which releases it), and the
wait must not end before that thread has finished its work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import sys
import threading

import pytest

from faccel._dist._settle import settle_gloo_workers

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="thread states come from /proc (Linux)")
NAME = "faccel-settle-t"  # at most 15 bytes: the kernel's limit for a thread's name


def _name_this_thread(name: str) -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    assert libc.prctl(15, name.encode(), 0, 0, 0) == 0  # PR_SET_NAME


def test_the_wait_ends_only_after_a_running_worker_has_finished() -> None:
    started, finished = threading.Event(), threading.Event()
    data = b"x" * (64 << 20)

    def worker() -> None:
        _name_this_thread(NAME)
        started.set()
        for _ in range(4):  # a few hundred ms of work, all of it without the lock
            hashlib.sha256(data).digest()
        finished.set()

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    assert settle_gloo_workers(limit=600, names=(NAME,))
    assert finished.is_set()
    thread.join()


def test_sleeping_workers_and_no_workers_settle_at_once() -> None:
    release = threading.Event()

    def sleeper() -> None:
        _name_this_thread(NAME)
        release.wait()

    thread = threading.Thread(target=sleeper)
    thread.start()
    try:
        assert settle_gloo_workers(limit=600, names=(NAME,))
        assert settle_gloo_workers(limit=600)  # this process has no gloo group
    finally:
        release.set()
        thread.join()


def test_a_worker_that_never_sleeps_ends_the_wait_at_the_limit() -> None:
    # Each hash runs without the lock for longer than the limit (256 MB: over 0.1 s at any speed
    # sha256 reaches, slower on a busy machine), so the wait sees the worker running throughout.
    # With short hashes it queued for the lock between two, asleep in the kernel's eyes, and a
    # busy machine once let the wait see that three checks in a row (a CI failure, 2026-12-06).
    stop, started = threading.Event(), threading.Event()
    data = b"x" * (256 << 20)

    def spinner() -> None:
        _name_this_thread(NAME)
        started.set()
        while not stop.is_set():
            hashlib.sha256(data).digest()

    thread = threading.Thread(target=spinner)
    thread.start()
    started.wait()
    try:
        assert not settle_gloo_workers(limit=0.05, names=(NAME,))
    finally:
        stop.set()
        thread.join()
