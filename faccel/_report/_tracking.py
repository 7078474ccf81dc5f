"""Experiment tracking: a tracker value made once, ``log`` that says whose numbers it writes.

A :class:`Tracker` is made by :func:`init_tracker` on every rank; it writes on the
main process only, unless ``per_rank=True`` gives each rank a folder of its own.
Hyperparameters are recorded once, when it is made. :func:`log` takes numbers or
scalar tensors and never reduces behind your back: a record says ``rank 0`` (the
main process's own values) or ``mean over 4 ranks`` (``reduce="mean"``, a
collective every rank must call). Close it with :func:`end_training` or a
``with`` block; nothing is kept in module state.

On a run of several ranks with a local ``logdir``, every rank also keeps its
hang record in ``logdir/hangs`` (``faccel._dist._hangs``): what it last
entered, which a timed-out collective's error quotes. The meter's measures
are logged under the standard names :data:`METER_NAMES` and
:data:`SPREAD_NAMES` (docs/observe.md).

Back-ends, one small writer each (the table ``_WRITERS``): ``jsonl`` (the default)
and ``csv`` need nothing (each record appended whole or not at all);
``tensorboard``, ``wandb`` (offline) and ``mlflow`` (a local SQLite store) use
their package when it is installed. ``jsonl`` and ``csv`` also take a URL
``logdir`` (``s3://bucket/run``): an object store cannot append, so the file is
kept in memory and its whole object rewritten (one PUT, atomic) at the first
record, then at most once every :data:`FLUSH_SECONDS`, and at the close.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import importlib.util
import io
import json
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import attrs
import torch

from faccel._choices import TRACKER_KIND, ReduceOpName, TrackerKind
from faccel._dist._hangs import HANGS_FOLDER
from faccel._dist._state import DistState
from faccel._report._metrics_file import METRICS_FILE, plot, read_metrics
from faccel._storage._roots import is_url, parse_root, shown, spot_of
from faccel._storage._store import Spot
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentError, ArgumentValueError, CheckpointError, StorageError

__all__ = [
    "METER_NAMES",
    "SPREAD_NAMES",
    "Tracker",
    "end_training",
    "init_tracker",
    "log",
    "plot",
    "read_metrics",
]

CONFIG_FILE = "config.json"
# The standard names a meter's measures are logged under (Meter.metrics), one table for every back-end
# and for `python -m faccel plot`, which draws them: the rank's rates, times, FLOP/s and peak memory.
METER_NAMES: Mapping[str, str] = {
    "items_per_second": "perf/items_per_second",
    "run_items_per_second": "perf/items_per_second_run",
    "step_seconds": "perf/step_seconds",
    "forward_seconds": "perf/forward_seconds",
    "tflops": "perf/tflops",
    "mfu": "perf/mfu",
    "peak_memory_gib": "memory/peak_gib",
}
# The ranks' step times at a straggler check (Spread.metrics): drawn together, one panel, as the spread.
SPREAD_NAMES: Mapping[str, str] = {
    "min": "step_time/min",
    "median": "step_time/median",
    "max": "step_time/max",
    "stragglers": "stragglers/count",
}
# On object storage, a log's object is rewritten at most this often (and at the first record and the close).
FLUSH_SECONDS = 10.0
# The back-ends that write to a URL logdir (the others' libraries write local files).
_URL_KINDS = ("jsonl", "csv")
# The back-ends kind="all" opens when their package is installed (jsonl always: read_metrics, plot).
_ALL = (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow"))


class _Writer(Protocol):
    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


# A path component's bytes on Linux and macOS (NAME_MAX): a longer project or run name cannot be a folder.
NAME_BYTES = 255
# How deep a config may nest: a hyperparameter tree is a few levels; json would recurse without end.
CONFIG_DEPTH = 64


def _config_text(config: Mapping[str, Any]) -> str:
    """The hyperparameters as ``config.json``'s text (values JSON cannot hold are written as text)."""
    _check_config(config)
    try:
        return json.dumps(dict(config), indent=1, sort_keys=True, default=str)
    except (TypeError, ValueError) as error:  # keys of several types that sort_keys cannot order
        msg = f"config could not be written as JSON ({error}); give it keys of one type (str)"
        raise ArgumentValueError(msg) from error


def _check_config(config: Mapping[str, Any]) -> None:
    """Refuse what ``json`` would fail on, before anything is written: a cycle, depth, a huge integer.

    An explicit stack, not recursion: a config 5,000 levels deep must not reach the interpreter's
    recursion limit.
    """
    stack: list[tuple[str, Any, tuple[int, ...]]] = [("config", config, ())]
    while stack:
        where, value, path = stack.pop()
        if isinstance(value, bool) or value is None or isinstance(value, float | str):
            continue
        if isinstance(value, int):
            _check_int(where, value)
            continue
        if not isinstance(value, Mapping | list | tuple):
            continue  # written as its str(), as JSON cannot hold it
        if id(value) in path:
            msg = f"config holds itself: {where} is the {type(value).__name__} that contains it; give a tree"
            raise ArgumentValueError(msg)
        if len(path) >= CONFIG_DEPTH:
            msg = f"config is nested deeper than {CONFIG_DEPTH} levels (at {where}); flatten it"
            raise ArgumentValueError(msg)
        inner = (*path, id(value))
        if isinstance(value, Mapping):
            for key, item in value.items():
                if not (key is None or isinstance(key, str | int | float | bool)):
                    msg = f"{where} has the key {key!r}; JSON keys are text or numbers: use str keys"
                    raise ArgumentValueError(msg)
                if isinstance(key, int) and not isinstance(key, bool):
                    _check_int(f"a key of {where}", key)
                stack.append((f"{where}[{key!r}]", item, inner))
        else:
            stack.extend((f"{where}[{index}]", item, inner) for index, item in enumerate(value))


def _check_int(where: str, value: int) -> None:
    # Python refuses to write an integer of more digits than sys.get_int_max_str_digits() (4,300).
    try:
        str(value)
    except ValueError:
        digits = int(abs(value).bit_length() * 0.30103) + 1
        msg = (
            f"{where} is an integer of {digits} digits, more than Python writes as text "
            "(sys.get_int_max_str_digits()); record it as a float, or as text you shorten"
        )
        raise ArgumentValueError(msg) from None


def _write_config(folder: Path | Spot, text: str) -> None:
    """``config.json`` whole or not at all: written beside, then renamed (a full disk leaves none);
    on object storage one upload, whole or not at all."""
    if isinstance(folder, Spot):
        _stored(folder / CONFIG_FILE, lambda spot: spot.store.replace(spot.key, [text.encode()]))
        return
    target = folder / CONFIG_FILE
    partial = folder / f".{CONFIG_FILE}.tmp"
    try:
        partial.write_text(text)
        os.replace(partial, target)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise


def _append(fd: int, data: bytes) -> None:
    """Append ``data`` whole or not at all: a short or failed write is cut back off (a full disk)."""
    before = os.fstat(fd).st_size
    try:
        written = os.write(fd, data)
        if written != len(data):  # a short write: the disk filled up part-way
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, before)
        raise


def _stored(spot: Spot, call: Callable[[Spot], Any]) -> Any:
    """``call(spot)`` on object storage; the store's named error (retries spent, a refusal) as an
    ``OSError``, which ``init_tracker`` and ``log`` report as a :class:`StorageError`."""
    try:
        return call(spot)
    except CheckpointError as error:
        raise OSError(errno.EIO, str(error)) from None


class _FileAppender:
    """A local log file, each record appended whole or not at all (``_append``)."""

    def __init__(self, path: Path, head: bytes) -> None:
        fresh = not path.exists()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if fresh and head:
            _append(self._fd, head)

    def append(self, data: bytes) -> None:
        _append(self._fd, data)

    def close(self) -> None:
        os.close(self._fd)


class _ObjectAppender:
    """A log object: an object store cannot append, so the file is kept here and its whole object
    rewritten (one upload: readers see the old object or the new one, never a part) at the first
    record, then at most once every :data:`FLUSH_SECONDS`, and at :meth:`close`. An object already
    there (a resumed run's) is read first and appended to. A failed upload keeps the records here:
    the next flush uploads them."""

    def __init__(self, spot: Spot, head: bytes) -> None:
        self._spot = spot
        there = _stored(spot, lambda s: s.size()) is not None
        old = _stored(spot, lambda s: s.read(None, where=str(s))[0].numpy().tobytes()) if there else b""
        self._data = bytearray(old if there else head)
        self._uploaded = len(old) if there else -1
        self._last = -FLUSH_SECONDS

    def append(self, data: bytes) -> None:
        self._data += data
        if time.monotonic() - self._last >= FLUSH_SECONDS:
            self.flush()

    def flush(self) -> None:
        if len(self._data) != self._uploaded:
            _stored(self._spot, lambda s: s.store.replace(s.key, [bytes(self._data)]))
            self._uploaded = len(self._data)
        self._last = time.monotonic()

    def close(self) -> None:
        self.flush()


def _appender(folder: Path | Spot, name: str, head: bytes = b"") -> _FileAppender | _ObjectAppender:
    """The log file ``name`` in ``folder`` opened for appending (``head`` first when it is new)."""
    if isinstance(folder, Spot):
        return _ObjectAppender(folder / name, head)
    return _FileAppender(folder / name, head)


class _JsonLines:
    """One JSON object a line: ``{"step", "time", "source", "metrics": {<name>: value ...}}``.

    The metrics sit in their own object, so any name (``step`` too) is a metric's.
    """

    def __init__(self, folder: Path | Spot, config: Mapping[str, Any], name: str, project: str) -> None:
        _write_config(folder, _config_text(config))
        self._out = _appender(folder, METRICS_FILE)

    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None:
        record = {"step": step, "time": round(elapsed, 6), "source": source, "metrics": dict(values)}
        self._out.append((json.dumps(record) + "\n").encode())

    def close(self) -> None:
        self._out.close()


def _csv_text(rows: list[list[Any]]) -> bytes:
    text = io.StringIO()
    csv.writer(text).writerows(rows)
    return text.getvalue().encode()


class _Csv:
    """Long format (``step,time,source,metric,value``), so new metric names need no new header."""

    def __init__(self, folder: Path | Spot, config: Mapping[str, Any], name: str, project: str) -> None:
        _write_config(folder, _config_text(config))
        self._out = _appender(
            folder, "metrics.csv", _csv_text([["step", "time", "source", "metric", "value"]])
        )

    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None:
        rows = [[step, f"{elapsed:.6f}", source, name, repr(value)] for name, value in values.items()]
        self._out.append(_csv_text(rows))

    def close(self) -> None:
        self._out.close()


def _hparam(value: Any) -> int | float | str | bool:
    """A hyperparameter as TensorBoard's hparams plugin takes it: numbers, text and booleans as is."""
    return value if isinstance(value, int | float | str | bool) else json.dumps(value, default=str)


class _TensorBoard:
    """Scalars in TensorBoard event files; the hyperparameters in its HPARAMS tab (``add_hparams``)."""

    def __init__(self, folder: Path, config: Mapping[str, Any], name: str, project: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(folder))
        if config:
            # run_name=".": the hparams go into this run's folder, not a new timestamped one.
            hparams = {key: _hparam(value) for key, value in config.items()}
            self._writer.add_hparams(hparams, {}, run_name=".")

    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class _Wandb:
    """A Weights & Biases run in offline mode (``wandb sync`` uploads it later)."""

    def __init__(self, folder: Path, config: Mapping[str, Any], name: str, project: str) -> None:
        import wandb

        self._run = wandb.init(
            dir=str(folder), mode="offline", config=dict(config), name=name, project=project, reinit=True
        )

    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def close(self) -> None:
        self._run.finish()


class _Mlflow:
    """An MLflow run in a local SQLite store (``folder/mlflow.db``), through the client: no global state."""

    def __init__(self, folder: Path, config: Mapping[str, Any], name: str, project: str) -> None:
        from mlflow.tracking import MlflowClient

        # MLflow 3 keeps its plain-file store for old runs only; SQLite is its local store now.
        self._client = MlflowClient(tracking_uri=f"sqlite:///{(folder / 'mlflow.db').resolve()}")
        found = self._client.get_experiment_by_name(project)
        experiment = found.experiment_id if found else self._client.create_experiment(project)
        self._run = self._client.create_run(experiment, run_name=name).info.run_id
        for key, value in config.items():
            self._client.log_param(self._run, key, value)

    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None:
        for key, value in values.items():
            self._client.log_metric(self._run, key, value, step=step)

    def close(self) -> None:
        self._client.set_terminated(self._run)


class _Each:
    """Several back-ends at once (``kind="all"``): each record goes to every one."""

    def __init__(self, writers: list[_Writer]) -> None:
        self._writers = writers

    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None:
        for writer in self._writers:
            writer.write(step, elapsed, source, values)

    def close(self) -> None:
        for writer in self._writers:
            writer.close()


# kind -> how to open its writer in a folder, with the hyperparameters, a run name and a project.
_WRITERS: Mapping[str, Callable[[Any, Mapping[str, Any], str, str], _Writer]] = {
    "jsonl": _JsonLines,
    "csv": _Csv,
    "tensorboard": _TensorBoard,
    "wandb": _Wandb,
    "mlflow": _Mlflow,
}


@attrs.frozen(kw_only=True, eq=False)
class Tracker:
    """Where this rank's metrics go: a back-end's writer, or nowhere on the ranks that do not log.

    Made by :func:`init_tracker`; pass it to :func:`log`; close it with
    :func:`end_training` or ``with``. The writer inside is a live object (an
    open file, a TensorBoard writer).

    Attributes:
        kind: The back-end (``jsonl``, ``csv``, ``tensorboard``, ``wandb``, ``mlflow``, ``all``).
        folder: Where this rank writes (a path, or the URL of a ``logdir`` on object
            storage); None on ranks that do not write.
        per_rank: Whether every rank writes (each in a folder of its own).

    Example:
        >>> import tempfile, faccel
        >>> with faccel.init_tracker(faccel.detect({}), tempfile.mkdtemp()) as tracker:
        ...     tracker.kind, tracker.folder is not None
        ('jsonl', True)
    """

    kind: TrackerKind
    folder: Path | str | None
    per_rank: bool = False
    _writer: _Writer | None = None
    _started: float = attrs.field(factory=time.monotonic)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._writer is not None:
            self._writer.close()


@setup_checked
def init_tracker(
    dist: DistState,
    logdir: str | os.PathLike[str],
    *,
    kind: TrackerKind = "jsonl",
    config: Mapping[str, Any] | None = None,
    per_rank: bool = False,
    run_name: str | None = None,
    project: str | None = None,
) -> Tracker:
    """A tracker writing to ``logdir`` (Accelerate's ``init_trackers``), made on every rank.

    Args:
        dist: The run's :class:`DistState`.
        logdir: The run's folder; created if missing. A URL (``s3://bucket/run``,
            through the optional extra that provides it) for ``jsonl`` and ``csv``:
            each log object rewritten whole, at most every ``FLUSH_SECONDS``
            (10 s) and at the close (docs/object-storage.md).
        kind: ``"jsonl"`` (default; ``metrics.jsonl`` and ``config.json``), ``"csv"``,
            ``"tensorboard"``, ``"wandb"`` (offline) or ``"mlflow"`` (``mlflow.db``, SQLite);
            ``"all"``: ``jsonl`` and every one of tensorboard, wandb and mlflow
            whose package is installed (Accelerate's ``log_with="all"``).
        config: Hyperparameters, recorded once: ``config.json``, TensorBoard's
            hparams, the W&B run's config, the MLflow run's params.
        per_rank: Every rank writes its own values to ``logdir/rank-NNNNN``;
            by default only the main process writes.
        run_name: A name for back-ends that show one (default: the folder's name);
            with ``project``, also the run's folder ``logdir/project/run_name``.
        project: The project (Accelerate's ``project_name``): the folder
            ``logdir/project`` (or ``logdir/project/run_name``), W&B's project and
            MLflow's experiment (default ``"faccel"``).

    Returns:
        The :class:`Tracker`; on ranks that do not write, one that writes nothing.

    Raises:
        ArgumentValueError: An unknown ``kind``, or a ``project`` or ``run_name``
            that is not one plain folder name; a URL ``logdir`` for a kind other
            than ``jsonl`` and ``csv``.
        MissingExtraError: A URL ``logdir`` whose protocol's extra is not installed.
        ArgumentError: The back-end's package is not installed.

    Example:
        >>> import json, pathlib, tempfile, faccel
        >>> run = pathlib.Path(tempfile.mkdtemp())
        >>> tracker = faccel.init_tracker(dist=faccel.detect({}), logdir=run, config={"lr": 0.1})
        >>> faccel.end_training(faccel.detect({}), tracker)
        >>> json.loads((run / "config.json").read_text())
        {'lr': 0.1}
        >>> with faccel.init_tracker(faccel.detect({}), run, project="clm", run_name="a") as tracker:
        ...     tracker.folder.relative_to(run).as_posix()
        'clm/a'
    """
    TRACKER_KIND.check(kind)  # one of _WRITERS' back-ends or "all" (faccel._choices)
    # Every name and value is checked on every rank before any folder or file is made.
    for what, part in (("project", project), ("run_name", run_name)):
        if part is not None:
            _check_name(what, part)
    options = dict(config or {})
    _check_config(options)
    # Parsed once, strictly, as every root is: 's3:/b/logs' is a mistyped URL, not a local folder.
    base: Path | Spot = Path(parse_root(logdir))
    if is_url(logdir):
        if kind not in _URL_KINDS:
            protocol = os.fspath(logdir).split("://", 1)[0]
            msg = (
                f"init_tracker: kind={kind!r} writes local files only (its library does), not to a "
                f"{protocol}:// logdir; use kind='jsonl' or 'csv' for a URL logdir, or a local logdir "
                "and copy it up after the run"
            )
            raise ArgumentValueError(msg)
        base = spot_of(logdir)
    if project is not None:
        base = base / project / run_name if run_name is not None else base / project
    if not per_rank and not dist.is_main_process:
        _record_hangs(dist, base)
        return Tracker(kind=kind, folder=None)
    folder = base / f"rank-{dist.rank:05d}" if per_rank else base
    kinds = [kind] if kind != "all" else ["jsonl", *(k for k, package in _ALL if _installed(package))]
    name = run_name or base.name
    # Removed again should writing fail (on object storage a folder is a prefix: nothing to make).
    made = [] if isinstance(folder, Spot) else [p for p in (folder, *folder.parents) if not p.exists()]
    try:
        if not isinstance(folder, Spot):
            folder.mkdir(parents=True, exist_ok=True)
        writers = [_WRITERS[k](folder, options, name, project or "faccel") for k in kinds]
    except ImportError as error:
        _remove_empty(made)
        msg = (
            f"the {kind!r} tracker needs the package {error.name!r}, which is not installed; "
            f"pip install {error.name}, or use kind='jsonl'"
        )
        raise ArgumentError(msg) from error
    except OSError as error:
        _remove_empty(made)
        msg = (
            f"init_tracker on rank {dist.rank} could not make the run's folder {folder} or write its "
            f"{CONFIG_FILE} ({error}); nothing was left behind. Free space on that disk, or choose a "
            "logdir you can write to"
        )
        raise StorageError(msg) from error
    _record_hangs(dist, base)
    writer = writers[0] if len(writers) == 1 else _Each(writers)
    where = shown(folder) if isinstance(folder, Spot) else folder
    return Tracker(kind=kind, folder=where, per_rank=per_rank, writer=writer)


def _record_hangs(dist: DistState, base: Path | Spot) -> None:
    """Have every rank of a run of several keep its hang record in ``base/hangs`` (a local logdir)."""
    if dist.distributed and dist.world_size > 1 and isinstance(base, Path):
        try:
            dist.runtime.record_hangs(base / HANGS_FOLDER, rank=dist.rank, local_rank=dist.local_rank)
        except OSError:  # a folder it cannot make: the run goes on, without hang records
            return


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders init_tracker made (innermost first), if nothing else was put in them."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _check_name(what: str, name: object) -> None:
    """A project, run or metric name: text, one plain folder name short enough for the disk."""
    if not isinstance(name, str):
        msg = f"{what} must be a str, got {type(name).__name__}"
        raise ArgumentError(msg)
    if name in ("", ".", "..") or "/" in name or os.sep in name:
        msg = f"{what} names a folder under logdir, so it must be one plain name, got {name!r}"
        raise ArgumentValueError(msg)
    _check_text(what, name)


def _check_text(what: str, name: str) -> None:
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        msg = f"{what} {name[:60]!r} holds a control character (a NUL, a newline ...); use printable text"
        raise ArgumentValueError(msg)
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > NAME_BYTES:
        msg = f"{what} must be at most {NAME_BYTES} bytes (a file name's limit), got {size}: {name[:40]!r}..."
        raise ArgumentValueError(msg)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # a module without a spec (already imported oddly): take it as there
        return True


def _scalar(name: object, value: Any) -> float:
    if not isinstance(name, str):
        msg = f"metric names must be str, got {name!r} ({type(name).__name__})"
        raise ArgumentError(msg)
    if not name:
        msg = "a metric name is empty; name it"
        raise ArgumentValueError(msg)
    _check_text(f"metric name {name[:60]!r}", name)
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            msg = f"metric {name!r} is a tensor of shape {list(value.shape)}; log a scalar (reduce it first)"
            raise ArgumentValueError(msg)
        if value.is_complex():
            msg = f"metric {name!r} is a complex tensor ({value.dtype}); log its real part or its abs()"
            raise ArgumentValueError(msg)
        return float(value.detach().item())
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"metric {name!r} must be a number or a one-element tensor, got {type(value).__name__}"
        raise ArgumentError(msg)
    try:
        return float(value)
    except OverflowError:
        msg = (
            f"metric {name!r} is an integer too large for a float (about 10**{len(str(value)) - 1}); "
            "every back-end records floats: log it scaled, or its log10"
        )
        raise ArgumentValueError(msg) from None


def log(
    dist: DistState,
    tracker: Tracker,
    step: int,
    metrics: Mapping[str, Any],
    *,
    reduce: ReduceOpName | None = None,
) -> None:
    """Record ``metrics`` at ``step``; each record says whose values they are.

    Without ``reduce`` the values are this rank's own: only the ranks whose
    tracker writes (the main process, or every rank with ``per_rank=True``)
    record them, as ``source: "rank R"``. With ``reduce="mean"`` (or ``"sum"``,
    ``"max"``, ``"min"``) they are first combined across the ranks (a
    collective: every rank must call ``log``) and recorded as
    ``source: "mean over N ranks"``.

    Args:
        dist: The run's :class:`DistState`.
        tracker: From :func:`init_tracker`.
        step: The step the values belong to (your optimizer step, usually).
        metrics: Name -> number or one-element tensor.
        reduce: Combine across ranks first: ``"mean"``, ``"sum"``, ``"max"``, ``"min"``.

    Raises:
        ArgumentError: A value that is not a number or tensor.
        ArgumentValueError: A tensor with more than one element, or a negative step.
        StorageError: The back-end's file could not be written (a full disk, a
            file size limit); the record is left out whole, the file holds every
            earlier one. Free space and log on, or catch it to keep training.

    Example:
        >>> import json, pathlib, tempfile, torch, faccel
        >>> dist, run = faccel.detect({}), pathlib.Path(tempfile.mkdtemp())
        >>> with faccel.init_tracker(dist, run) as tracker:
        ...     faccel.log(dist, tracker, 1, {"loss": torch.tensor(0.5), "lr": 0.1})
        >>> record = json.loads((run / "metrics.jsonl").read_text())
        >>> record["source"], record["metrics"]
        ('rank 0', {'loss': 0.5, 'lr': 0.1})
    """
    if isinstance(step, bool) or not isinstance(step, int):
        msg = f"step must be an int (your optimizer step), got {type(step).__name__} {step!r}"
        raise ArgumentError(msg)
    if not 0 <= step < 2**63:  # TensorBoard, W&B and MLflow keep steps as 64-bit integers
        shown = step if abs(step) < 2**63 else f"an integer of {abs(step).bit_length()} bits"
        msg = f"step must be >= 0 and < 2**63, got {shown}"
        raise ArgumentValueError(msg)
    values = {name: _scalar(name, value) for name, value in metrics.items()}
    source = f"rank {dist.rank}"
    if reduce is not None:
        from faccel._dist._collectives import reduce as reduce_tree

        names = sorted(values)
        stacked = torch.tensor([values[n] for n in names], dtype=torch.float64, device=dist.device)
        combined = reduce_tree(dist, stacked, op=reduce).tolist()
        values = dict(zip(names, combined, strict=True))
        source = f"{reduce} over {dist.world_size} rank{'s' if dist.world_size > 1 else ''}"
    if tracker._writer is not None:
        try:
            tracker._writer.write(step, time.monotonic() - tracker._started, source, values)
        except OSError as error:
            msg = (
                f"rank {dist.rank} could not record step {step} in {tracker.folder} ({error}); the "
                "record was left out whole and the file keeps every earlier one. Free space on that "
                "disk (or raise its size limit) and log on, or catch faccel.errors.StorageError to "
                "train on without this record"
            )
            if isinstance(tracker.folder, str):  # object storage: the records wait for the next upload
                msg = (
                    f"rank {dist.rank} could not upload the log in {tracker.folder} at step {step} "
                    f"({error}); this record and those not yet uploaded are kept and go with the next "
                    "upload (the next log or the close). Catch faccel.errors.StorageError to train on"
                )
            raise StorageError(msg) from error


def end_training(dist: DistState, tracker: Tracker) -> None:
    """Close ``tracker``'s writer (Accelerate's ``end_training``); a no-op where it writes nothing.

    Example:
        >>> import tempfile, faccel
        >>> dist = faccel.detect({})
        >>> faccel.end_training(dist, faccel.init_tracker(dist, tempfile.mkdtemp(), kind="csv"))
    """
    tracker.__exit__(None, None, None)
