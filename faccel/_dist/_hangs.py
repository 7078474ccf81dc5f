"""Hang records: what each rank last entered, in a small JSON file beside the run's logs.

Where a run has logs on a local disk (:func:`faccel.init_tracker` names the
folder) and several ranks, each rank keeps ``LOGDIR/hangs/rank-NNNNN.json``
up to date: the faccel call it last entered (a collective and its number among
this rank's collectives), the phase of the step (``forward``, ``backward``,
``optimizer``, ``checkpoint``...), the step, the host and local rank. It is
rewritten (whole: written beside, then renamed) when the rank enters a
collective, and by a small thread of the runtime handle when the phase moved
on since the last write (at most every :data:`WRITE_SECONDS`), so a rank that
stops (hung in a kernel, blocked on I/O, stopped by a debugger) leaves its
last phase on the disk without a write per step. When a faccel collective
times out, the rank that waited reads its peers' records and names, in the
error, each rank that never arrived and what it was doing; the records stay
for whoever reads the run afterwards. On NCCL, torch's own flight recorder
(``TORCH_NCCL_TRACE_BUFFER_SIZE``) records the kernels; these records say
where faccel's side of the loop was.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import attrs

__all__ = ["HANGS_FOLDER", "MAX_RECORD_BYTES", "WRITE_SECONDS", "HangRecord", "read_record", "write_record"]

HANGS_FOLDER = "hangs"
# A record is a few hundred bytes; anything larger in its place was not written by faccel.
MAX_RECORD_BYTES = 1 << 14
# The longest a phase change waits before the runtime's thread writes it down.
WRITE_SECONDS = 0.25


@attrs.frozen(kw_only=True)
class HangRecord:
    """What one rank last entered: the content of ``hangs/rank-NNNNN.json``.

    Attributes:
        rank: The rank.
        host: Its host's name.
        local_rank: Its index on that host.
        call: The faccel call it last entered (``gather``, ``checkpoint``...).
        number: That call's number among the rank's collectives (0 before any).
        phase: The step's phase it was in: ``setup``, ``forward``, ``backward``,
            ``optimizer``, ``checkpoint``, or the collective's name.
        step: The last training step faccel saw, or None.
        backwards: ``faccel.backward`` calls so far.
        time: When it was written (seconds since the epoch).
        state: ``running``, or what ended it (``timed out in gather``).
    """

    rank: int
    host: str
    local_rank: int
    call: str
    number: int
    phase: str
    step: int | None
    backwards: int
    time: float
    state: str = "running"

    def describe(self) -> str:
        """``rank 1 (host a, local rank 1): in backward after gather() (its collective #3), at step 7``."""
        step = "before any step faccel saw" if self.step is None else f"at step {self.step}"
        return (
            f"rank {self.rank} (host {self.host}, local rank {self.local_rank}): in {self.phase} after "
            f"{self.call}() (its collective #{self.number}), {step}, after {self.backwards} backward calls"
        )


def record_path(folder: Path, rank: int) -> Path:
    """The record of ``rank`` in ``folder``: ``rank-NNNNN.json``."""
    return folder / f"rank-{rank:05d}.json"


def here() -> str:
    """This host's name."""
    return socket.gethostname()


def write_record(folder: Path, record: HangRecord) -> None:
    """Write ``record`` whole (beside its place, then renamed); a disk that refuses is left alone.

    A hang record must never be the reason a run stops: a failed write keeps
    the previous record, and training goes on.

    Example:
        >>> import pathlib, tempfile
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> made = HangRecord(rank=1, host="a", local_rank=1, call="gather", number=3,
        ...                   phase="backward", step=7, backwards=8, time=0.0)
        >>> write_record(folder, made)
        >>> read_record(folder, 1) == made
        True
    """
    target = record_path(folder, record.rank)
    # One partial file a thread: the runtime's thread and the loop's collectives may both write.
    partial = target.with_name(f".{target.name}.tmp-{threading.get_ident()}")
    with contextlib.suppress(OSError):
        partial.write_text(json.dumps(attrs.asdict(record)))
        os.replace(partial, target)


def _field(data: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    value = data.get(name)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise ValueError(name)
    return value


def read_record(folder: Path, rank: int) -> HangRecord | None:
    """The record ``rank`` wrote in ``folder``; None where there is none, or it is not one faccel wrote.

    Read bounded: a regular file of at most :data:`MAX_RECORD_BYTES`.
    """
    try:
        fd = os.open(record_path(folder, rank), os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_RECORD_BYTES:
            return None
        data = json.loads(os.read(fd, MAX_RECORD_BYTES + 1))
        step = data.get("step")
        return HangRecord(
            rank=_field(data, "rank", int),
            host=_field(data, "host", str),
            local_rank=_field(data, "local_rank", int),
            call=_field(data, "call", str),
            number=_field(data, "number", int),
            phase=_field(data, "phase", str),
            step=step if isinstance(step, int) and not isinstance(step, bool) else None,
            backwards=_field(data, "backwards", int),
            time=float(_field(data, "time", (int, float))),
            state=_field(data, "state", str),
        )
    except (OSError, ValueError, AttributeError):  # unreadable, not JSON, not a record
        return None
    finally:
        os.close(fd)


def now() -> float:
    """The wall clock a record carries."""
    return time.time()
