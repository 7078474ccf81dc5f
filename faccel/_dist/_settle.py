"""Let gloo's worker threads finish with Python objects before the interpreter ends.

A gloo collective runs on one of the process group's worker threads
(``pt_gloo_runloop``). When it completes, the rank that waited for it goes on
at once, while the worker still holds the collective's work, and with it the
tensors the collective was given. If the script has dropped those tensors
already, the worker's release is the last one, and freeing a tensor that
Python knew needs the interpreter lock. Should the script end in that moment,
Python 3.11 is finalizing when the worker asks for the lock, and ends the
thread where it stands: the unwind meets a C++ destructor and the process
aborts with "terminate called without an active exception" (SIGABRT), after
a run that did everything right; torchrun then reports the job failed.

``destroy_process_group`` does not help while anything still holds the group
(an FSDP2 module keeps it, a DDP wrapper pins it): the workers live on.
:func:`settle_gloo_workers` therefore waits, with the interpreter lock
released, until every gloo worker thread has been seen asleep several times
in a row: a worker queued for the lock gets it during the wait, a worker
still running is waited for. It reads the threads' states from
``/proc/self/task`` (Linux); elsewhere it returns at once.
"""

from __future__ import annotations

import os
import time

__all__ = ["settle_gloo_workers"]

# The name torch gives ProcessGroupGloo's worker threads (its runLoop).
GLOO_WORKER = "pt_gloo_runloop"
_TASKS = "/proc/self/task"
# Asleep this many checks in a row, each after a pause without the lock: one pause lets a
# worker that queued for the lock take it; the others cover a worker woken by that pause.
_QUIET_CHECKS = 3
_PAUSE = 0.001


def _worker_running(names: tuple[str, ...]) -> bool:
    """Whether a thread of this process named one of ``names`` is running or runnable."""
    try:
        tasks = os.listdir(_TASKS)
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"{_TASKS}/{task}/comm") as file:
                if file.read().strip() not in names:
                    continue
            with open(f"{_TASKS}/{task}/stat") as file:
                stat = file.read()
        except OSError:  # the thread ended meanwhile
            continue
        # "pid (comm) S ...": the state is the field after the name, which may hold spaces.
        if stat[stat.rindex(")") + 2] == "R":
            return True
    return False


def settle_gloo_workers(*, limit: float = 5.0, names: tuple[str, ...] = (GLOO_WORKER,)) -> bool:
    """Wait until this process's gloo worker threads are asleep; True if they settled within ``limit`` s.

    Called when faccel stops the process group (:func:`faccel.shutdown`, and
    at exit for a script that never called it), after the last collective.
    The pauses release the interpreter lock, so a worker that still has to
    free a collective's tensors can. ``limit`` bounds the wait; past it
    the process goes on as it would have.

    Example:
        >>> settle_gloo_workers()  # no process group here: nothing to wait for
        True
    """
    deadline = time.monotonic() + limit
    quiet = 0
    while quiet < _QUIET_CHECKS:
        if time.monotonic() > deadline:
            return False
        time.sleep(_PAUSE)
        quiet = 0 if _worker_running(names) else quiet + 1
    return True
