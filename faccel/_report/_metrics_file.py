"""A run's ``metrics.jsonl`` read back and drawn, bounded by what is on disk and by fixed caps.

:func:`read_metrics` and :func:`plot` (``python -m faccel plot``) take a path a
user typed, so they trust nothing in it: only a regular file is opened (opened
without blocking, so a FIFO or a device is named, never waited on), its size is
checked against :data:`MAX_BYTES` before a byte is read, each line against
:data:`MAX_LINE`, and each record's shape and values before it is kept. A plot
draws at most :data:`MAX_METRICS` panels, and is written beside its target and
renamed, so a failed write leaves no half image. Every refusal is an
:class:`~faccel.errors.ArgumentValueError` (the file is not what a tracker
writes) or a :class:`~faccel.errors.StorageError` (the disk refused the write).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, cast

from faccel._storage._roots import is_url, spot_of
from faccel.errors import ArgumentValueError, StorageError

__all__ = [
    "MAX_BYTES",
    "MAX_LINE",
    "MAX_METRICS",
    "METRICS_FILE",
    "PLOT_SUFFIXES",
    "open_user_file",
    "plot",
    "read_metrics",
]

METRICS_FILE = "metrics.jsonl"
# The largest metrics.jsonl read back: about 800,000 records of one metric (64 MiB of text, a few
# hundred MB of points in memory); a longer run plots from a copy cut to its last part.
MAX_BYTES = 64 << 20
# The longest line: a record of a few thousand metrics. A tracker writes nothing longer.
MAX_LINE = 1 << 20
# Panels in one plot (three a row): more would be an image too tall to read.
MAX_METRICS = 64
# The formats plot writes, by the target's suffix: matplotlib's images, and a self-contained HTML page.
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".html")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a plain file"


def open_user_file(path: Path, *, what: str, limit: int) -> bytes:
    """The bytes of the regular file ``path`` (links followed), at most ``limit`` of them.

    Opened without blocking (a FIFO is refused, not waited on), checked with
    ``fstat`` to be a regular file no larger than ``limit`` before anything is
    read; a file that grows while it is read is refused too.

    Raises:
        ArgumentValueError: ``path`` is missing, not a regular file, or larger than ``limit``.

    Example:
        >>> import pathlib, tempfile
        >>> file = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
        >>> _ = file.write_text("hello")
        >>> open_user_file(file, what="the file", limit=100)
        b'hello'
        >>> open_user_file(pathlib.Path("/dev/zero"), what="the file", limit=100)
        Traceback (most recent call last):
        faccel.errors.ArgumentValueError: the file /dev/zero is a device, not a regular file; give a file
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        msg = f"{what} {path} does not exist"
        raise ArgumentValueError(msg) from None
    except OSError as error:
        msg = f"{what} {path} cannot be opened ({error.strerror})"
        raise ArgumentValueError(msg) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            msg = f"{what} {path} is {_kind(info.st_mode)}, not a regular file; give a file"
            raise ArgumentValueError(msg)
        if info.st_size > limit:
            msg = (
                f"{what} {path} has {info.st_size} bytes, more than the {_size(limit)} read here; "
                "give a smaller file (a copy cut to the part you need)"
            )
            raise ArgumentValueError(msg)
        chunks, left = [], limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
        if len(data) > limit:
            msg = f"{what} {path} grew past {_size(limit)} while it was read; read it once it is written"
            raise ArgumentValueError(msg)
        return data
    finally:
        os.close(fd)


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n} bytes"


def _metrics_path(run: str | os.PathLike[str]) -> Path:
    path = Path(run)
    if not str(run):
        msg = "the run is empty; give a run's folder (with metrics.jsonl) or the file itself"
        raise ArgumentValueError(msg)
    if path.is_dir():
        return path / METRICS_FILE
    if not path.exists() and not path.is_symlink():
        msg = f"the run {path} does not exist; give a run's folder (with {METRICS_FILE}) or the file itself"
        raise ArgumentValueError(msg)
    return path


def _record(line: str, where: str) -> dict[str, object]:
    try:
        record = json.loads(line)
    except RecursionError:
        msg = f"{where} is nested too deep to be a record a tracker wrote"
        raise ArgumentValueError(msg) from None
    except ValueError as error:  # json's own error, or an integer of more digits than Python reads
        msg = f"{where} is not JSON ({error}); is this a metrics.jsonl that faccel's tracker wrote?"
        raise ArgumentValueError(msg) from None
    if not isinstance(record, dict) or not isinstance(record.get("metrics"), dict) or "step" not in record:
        msg = (
            f'{where} is not a record a tracker writes ({{"step": ..., "metrics": {{name: value}}}}), '
            f"got {line[:80]!r}"
        )
        raise ArgumentValueError(msg)
    return record


def _step(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{where}: the step is {value!r}, not an integer"
        raise ArgumentValueError(msg)
    if isinstance(value, float):
        if not value.is_integer():  # inf, nan, 1.5
            msg = f"{where}: the step is {value!r}, not an integer"
            raise ArgumentValueError(msg)
        value = int(value)
    return value


def _value(name: str, value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"{where}: metric {name!r} is {value!r}, not a number"
        raise ArgumentValueError(msg)
    try:
        return float(value)
    except OverflowError:
        msg = f"{where}: metric {name!r} is an integer too large for a float"
        raise ArgumentValueError(msg) from None


def _metrics_object(url: str) -> tuple[str, bytes]:
    """The URL and bytes of a run's metrics object (``url`` names it, or the logdir that holds it)."""
    from faccel.errors import CheckpointError

    spot = spot_of(url)
    if not spot.name.endswith(".jsonl"):
        spot = spot / METRICS_FILE
    try:
        buffer, _ = spot.read(None, where=f"the metrics file {spot}", limit=MAX_BYTES)
    except CheckpointError as error:  # missing, larger than MAX_BYTES, or the store refused
        raise ArgumentValueError(str(error)) from None
    return str(spot), buffer.numpy().tobytes()


def read_metrics(run: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Metric name -> ``(step, value)`` pairs from a run's ``metrics.jsonl`` (or the file itself),
    on the disk or at a URL of object storage (a tracker's URL logdir).

    Reads at most :data:`MAX_BYTES` (64 MiB) from a regular file, lines of at
    most :data:`MAX_LINE` (1 MiB); blank lines are skipped.

    Raises:
        ArgumentValueError: The run or its file is missing, not a regular file, too
            large, not UTF-8, or a line is not a record a tracker writes (named by number).

    Example:
        >>> import pathlib, tempfile, faccel
        >>> dist, run = faccel.detect({}), pathlib.Path(tempfile.mkdtemp())
        >>> with faccel.init_tracker(dist, run) as tracker:
        ...     for step in range(3):
        ...         faccel.log(dist, tracker, step, {"loss": 1.0 / (step + 1)})
        >>> read_metrics(run)["loss"]
        [(0, 1.0), (1, 0.5), (2, 0.3333333333333333)]
    """
    path: Path | str
    if is_url(run):  # a tracker's logdir on object storage: one ranged GET, at most MAX_BYTES
        path, data = _metrics_object(os.fspath(run))
    else:
        path = _metrics_path(run)
        data = open_user_file(path, what="the metrics file", limit=MAX_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        msg = (
            f"the metrics file {path} is not UTF-8 text (byte {error.start} is {data[error.start]:#04x}); "
            "a tracker writes JSON lines"
        )
        raise ArgumentValueError(msg) from None
    curves: dict[str, list[tuple[int, float]]] = {}
    for number, line in enumerate(text.split("\n"), start=1):
        where = f"{path}, line {number}"
        if len(line) > MAX_LINE:
            msg = f"{where} is longer than {_size(MAX_LINE)}; a tracker writes no such line"
            raise ArgumentValueError(msg)
        if not line.strip():
            continue
        record = _record(line, where)
        step = _step(record["step"], where)
        metrics = cast(dict[str, object], record["metrics"])  # a dict: _record checked it
        for name, value in metrics.items():
            curves.setdefault(name, []).append((step, _value(name, value, where)))
    return curves


def _target(run: str | os.PathLike[str], out: str | os.PathLike[str] | None) -> Path:
    """Where the plot goes, checked before anything is read: a file of a known image type in a folder."""
    if out is None:
        path = Path(run)
        return (path if path.is_dir() else path.parent) / "metrics.png"
    target = Path(out)
    if not str(out):
        msg = "out is empty; give the image's path (e.g. run/metrics.png)"
        raise ArgumentValueError(msg)
    if target.is_dir():
        msg = f"out {target} is a folder; give a file in it, e.g. {target / 'metrics.png'}"
        raise ArgumentValueError(msg)
    if target.exists() and not target.is_file():
        msg = f"out {target} is {_kind(target.stat().st_mode)}, not a regular file; plot writes files only"
        raise ArgumentValueError(msg)
    if target.suffix.lower() not in PLOT_SUFFIXES:
        msg = (
            f"out {target} must end in {', '.join(PLOT_SUFFIXES[:-1])} or {PLOT_SUFFIXES[-1]} (the image's "
            f"format), got {target.suffix or 'no suffix'!r}; e.g. {target.with_suffix('.png')}"
        )
        raise ArgumentValueError(msg)
    if not target.parent.is_dir():
        msg = f"out {target}: the folder {target.parent} does not exist; make it first"
        raise ArgumentValueError(msg)
    return target


def plot(run: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw every metric of a JSONL run against its step into one image or page; returns its path.

    A metric has a panel of its own, except the ranks' step-time spread
    (``step_time/min``, ``/median``, ``/max``, logged from ``Spread.metrics()``),
    which shares one; the meter's throughput, MFU and memory are metrics like the
    loss (docs/observe.md). The default output is ``metrics.png`` beside
    ``metrics.jsonl`` (needs matplotlib); ``out`` ends in ``.png``, ``.pdf`` or
    ``.svg`` (the image's format), or ``.html``: a self-contained page with the
    same curves in the same colours (inline SVG, no script; needs nothing). It
    is written whole (beside it, then renamed) or not at all. At most
    :data:`MAX_METRICS` metrics.

    Raises:
        ArgumentValueError: ``out`` is a folder, not a file, of another suffix or in a
            missing folder; the run cannot be read (:func:`read_metrics`), holds no
            metrics or more than :data:`MAX_METRICS`.
        StorageError: The image could not be written (a full disk); nothing is left.
    """
    target = _target(run, out)
    curves = read_metrics(run)
    if not curves:
        msg = f"{run} holds no metrics to plot"
        raise ArgumentValueError(msg)
    if len(curves) > MAX_METRICS:
        msg = (
            f"{run} holds {len(curves)} metrics; plot draws at most {MAX_METRICS} (one panel each): "
            "read them with faccel._report._metrics_file.read_metrics and draw the ones you need"
        )
        raise ArgumentValueError(msg)
    suffix = target.suffix.lower()
    if suffix == ".html":
        from faccel._report._plot_html import html_page

        page = html_page(curves, title=f"faccel run {Path(run).name}").encode()
        _write_whole(target, lambda file: file.write(page))
        return target
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from faccel._report._plot_panels import panels

    planned = panels(list(curves))
    rows, columns = (len(planned) + 2) // 3, min(len(planned), 3)
    figure = Figure(figsize=(5 * columns, 3.5 * rows), dpi=100)
    FigureCanvasAgg(figure)
    for index, panel in enumerate(planned, start=1):
        axes = figure.add_subplot(rows, columns, index)
        for name, colour in panel.series:
            steps, values = zip(*curves[name], strict=True)
            finite = [v if math.isfinite(v) else math.nan for v in values]
            axes.plot(
                steps, finite, color=colour, linewidth=2.5, label=name, marker="o" if len(steps) == 1 else ""
            )
        axes.set_title(panel.title)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
        if len(panel.series) > 1:
            axes.legend(fontsize="small")
    figure.tight_layout()
    _write_whole(target, lambda file: figure.savefig(file, format=suffix.lstrip(".")))
    return target


def _write_whole(target: Path, write: Callable[[BinaryIO], object]) -> None:
    """``write`` into a file beside ``target``, flushed and renamed into place; nothing left on failure."""
    partial = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        with open(partial, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, target)
    except OSError as error:
        with contextlib.suppress(OSError):
            partial.unlink()
        msg = f"plot could not write {target} ({error}); nothing was left there. Free space, or choose out="
        raise StorageError(msg) from error
