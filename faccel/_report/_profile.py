"""``torch.profiler`` for a run: one trace per rank, a schedule, export (``accelerator.profile``).

The profiler is torch's own and is yielded as is (``prof.step()``,
``prof.key_averages()``). What faccel adds is the naming and the meeting: with
``trace_dir`` each rank writes ``trace_dir/profile_RANK.json`` (Chrome trace,
Accelerate's name) when the block ends, or, under a ``schedule``,
``profile_RANK_stepN.json`` at the end of each active cycle; the ranks then wait
for each other, so the folder is complete on return.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from faccel._dist._process_group import wait_for_everyone
from faccel._dist._state import DistState
from faccel._storage._roots import refuse_url
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError

__all__ = ["profile"]

_SCHEDULE_KEYS = ("wait", "warmup", "active", "repeat", "skip_first")
# The least each schedule key takes: an active phase of 0 steps would record nothing, ever.
_SCHEDULE_LEAST = {"wait": 0, "warmup": 0, "active": 1, "repeat": 0, "skip_first": 0}


def _check_schedule(schedule: Mapping[str, Any]) -> None:
    """Refuse a key ``torch.profiler.schedule`` does not take, or a count it would take wrongly."""
    unknown = sorted(set(schedule) - set(_SCHEDULE_KEYS))
    if unknown:
        msg = f"schedule keys {unknown} are not torch.profiler.schedule's; it takes {list(_SCHEDULE_KEYS)}"
        raise ArgumentValueError(msg)
    for key, value in schedule.items():
        least = _SCHEDULE_LEAST[key]
        if type(value) is not int or value < least:
            msg = (
                f"profile(schedule={{{key!r}: {value!r}}}): {key} is a number of steps, an int >= {least}"
                f"{' (an active phase of 0 steps records nothing)' if key == 'active' else ''}; "
                "for example schedule={'wait': 1, 'warmup': 1, 'active': 2}"
            )
            raise ArgumentValueError(msg)


def _trace_folder(trace_dir: str | os.PathLike[str]) -> Path:
    """``trace_dir`` as a local folder, made if missing; refused by name when it cannot be one."""
    refuse_url(trace_dir, what="profile's trace_dir")
    text = os.fspath(trace_dir)
    if not text or "\x00" in text:
        msg = f"profile's trace_dir {text!r} is not a folder name (empty, or holding a NUL byte); pass a path"
        raise ArgumentValueError(msg)
    folder = Path(text)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        msg = f"profile's trace_dir {text!r} is a file, not a folder; pass a folder for the traces"
        raise ArgumentValueError(msg) from None
    except NotADirectoryError:
        msg = f"profile's trace_dir {text!r} lies under a file, not a folder; pass a folder for the traces"
        raise ArgumentValueError(msg) from None
    return folder


@contextlib.contextmanager
@setup_checked
def profile(
    dist: DistState,
    trace_dir: str | os.PathLike[str] | None = None,
    *,
    schedule: Mapping[str, int] | None = None,
    on_trace_ready: Callable[[Any], None] | None = None,
    record_shapes: bool = False,
    profile_memory: bool = False,
    with_stack: bool = False,
    with_flops: bool = False,
    with_modules: bool = False,
) -> Iterator[Any]:
    """Profile the block with ``torch.profiler.profile``; one Chrome trace per rank in ``trace_dir``.

    Activities: the CPU, and CUDA when ``dist.device`` is a GPU. Every rank
    must enter the block when ``trace_dir`` is given (the ranks meet at its end).

    Args:
        dist: The run's :class:`DistState`.
        trace_dir: Where each rank writes ``profile_RANK.json`` (created); None
            writes nothing (read the yielded profiler).
        schedule: ``torch.profiler.schedule``'s keywords (``wait``, ``warmup``,
            ``active``, ``repeat``, ``skip_first``; ``wait`` and ``warmup``
            default to 0); call ``prof.step()`` after
            each step. With ``trace_dir``, each active cycle's trace is written
            as ``profile_RANK_stepN.json``.
        on_trace_ready: Called with the profiler at the end of each active
            cycle (after the trace is written, when ``trace_dir`` is given).
        record_shapes: As ``torch.profiler.profile``.
        profile_memory: As ``torch.profiler.profile``.
        with_stack: As ``torch.profiler.profile``.
        with_flops: As ``torch.profiler.profile``.
        with_modules: As ``torch.profiler.profile``.

    Yields:
        The running ``torch.profiler.profile``.

    Raises:
        ArgumentError: an argument of another type (``schedule={'wait': '1'}``).
        ArgumentValueError: a ``schedule`` key torch's schedule does not take, a
            count below 0 (``active`` below 1); a URL ``trace_dir`` (torch writes
            local files: profile locally, copy the traces up), one that is a file
            or holds a NUL byte.

    Example:
        >>> import tempfile, torch, faccel
        >>> out = tempfile.mkdtemp()
        >>> with faccel.profile(faccel.detect({}), out) as prof:
        ...     _ = torch.ones(8, 8) @ torch.ones(8, 8)
        >>> sorted(os.listdir(out))
        ['profile_0.json']
    """
    if schedule is not None:
        _check_schedule(schedule)
    folder = None if trace_dir is None else _trace_folder(trace_dir)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if dist.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def ready(prof: Any) -> None:
        if folder is not None:
            prof.export_chrome_trace(str(folder / f"profile_{dist.rank}_step{prof.step_num}.json"))
        if on_trace_ready is not None:
            on_trace_ready(prof)

    scheduled = schedule is not None
    with torch.profiler.profile(
        activities=activities,
        schedule=None
        if schedule is None
        else torch.profiler.schedule(**{"wait": 0, "warmup": 0, **schedule}),
        on_trace_ready=ready if scheduled or on_trace_ready is not None else None,
        record_shapes=record_shapes,
        profile_memory=profile_memory,
        with_stack=with_stack,
        with_flops=with_flops,
        with_modules=with_modules,
    ) as prof:
        yield prof
    if folder is None:
        return
    if not scheduled:
        prof.export_chrome_trace(str(folder / f"profile_{dist.rank}.json"))
    wait_for_everyone(dist)
