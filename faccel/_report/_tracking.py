"""Experiment tracking: a tracker value made once, ``log`` that says whose numbers it writes.

A :class:`Tracker` is made by :func:`init_tracker` on every rank; it writes on the
main process only, unless ``per_rank=True`` gives each rank a folder of its own.
Hyperparameters are recorded once, when it is made. :func:`log` takes numbers or
scalar tensors and never reduces behind your back: a record says ``rank 0`` (the
main process's own values) or ``mean over 4 ranks`` (``reduce="mean"``, a
collective every rank must call). Close it with :func:`end_training` or a
``with`` block; nothing is kept in module state.

Back-ends, one small writer each (the table ``_WRITERS``): ``jsonl`` (the default)
and ``csv`` need nothing (each record appended whole or not at all);
``tensorboard``, ``wandb`` (offline) and ``mlflow`` (a local SQLite store) use
their package when it is installed.
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

from faccel._choices import TRACKER_KIND, TrackerKind
from faccel._dist._state import DistState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentError, ArgumentValueError, StorageError

__all__ = ["Tracker", "end_training", "init_tracker", "log"]

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
# The back-ends kind="all" opens when their package is installed (jsonl always: read_metrics, plot).
_ALL = (("tensorboard", "tensorboard"), ("wandb", "wandb"), ("mlflow", "mlflow"))


class _Writer(Protocol):
    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


def _write_config(folder: Path, config: Mapping[str, Any]) -> None:
    """The hyperparameters as ``config.json`` (values JSON cannot hold are written as text)."""
    (folder / CONFIG_FILE).write_text(json.dumps(dict(config), indent=1, sort_keys=True, default=str))


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


class _JsonLines:
    """One JSON object a line: ``{"step", "time", "source", "metrics": {<name>: value ...}}``.

    The metrics sit in their own object, so any name (``step`` too) is a metric's.
    """

    def __init__(self, folder: Path, config: Mapping[str, Any], name: str, project: str) -> None:
        _write_config(folder, config)
        self._fd = os.open(
            folder / METRICS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644
        )

    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None:
        record = {"step": step, "time": round(elapsed, 6), "source": source, "metrics": dict(values)}
        _append(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class _Csv:
    """Long format (``step,time,source,metric,value``), so new metric names need no new header."""

    def __init__(self, folder: Path, config: Mapping[str, Any], name: str, project: str) -> None:
        _write_config(folder, config)
        path = folder / "metrics.csv"
        fresh = not path.exists()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if fresh:
            self._rows([["step", "time", "source", "metric", "value"]])

    def _rows(self, rows: list[list[Any]]) -> None:
        text = io.StringIO()
        csv.writer(text).writerows(rows)
        _append(self._fd, text.getvalue().encode())

    def write(self, step: int, elapsed: float, source: str, values: Mapping[str, float]) -> None:
        self._rows([[step, f"{elapsed:.6f}", source, name, repr(value)] for name, value in values.items()])

    def close(self) -> None:
        os.close(self._fd)


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
_WRITERS: Mapping[str, Callable[[Path, Mapping[str, Any], str, str], _Writer]] = {
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
        folder: Where this rank writes; None on ranks that do not write.
        per_rank: Whether every rank writes (each in a folder of its own).

    Example:
        >>> import tempfile, faccel
        >>> with faccel.init_tracker(faccel.detect({}), tempfile.mkdtemp()) as tracker:
        ...     tracker.kind, tracker.folder is not None
        ('jsonl', True)
    """

    kind: str
    folder: Path | None
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
        logdir: The run's folder; created if missing.
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
            that is not one plain folder name.
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
    base = Path(logdir)
    if project is not None:
        for what, part in (("project", project), ("run_name", run_name)):
            if part is not None and (part in ("", ".", "..") or "/" in part or os.sep in part):
                msg = f"{what} names a folder under logdir, so it must be one plain name, got {part!r}"
                raise ArgumentValueError(msg)
        base = base / project / run_name if run_name is not None else base / project
    if not per_rank and not dist.is_main_process:
        return Tracker(kind=kind, folder=None)
    folder = base / f"rank-{dist.rank:05d}" if per_rank else base
    folder.mkdir(parents=True, exist_ok=True)
    kinds = [kind] if kind != "all" else ["jsonl", *(k for k, package in _ALL if _installed(package))]
    name, options = run_name or base.name, dict(config or {})
    try:
        writers = [_WRITERS[k](folder, options, name, project or "faccel") for k in kinds]
    except ImportError as error:
        msg = (
            f"the {kind!r} tracker needs the package {error.name!r}, which is not installed; "
            f"pip install {error.name}, or use kind='jsonl'"
        )
        raise ArgumentError(msg) from error
    writer = writers[0] if len(writers) == 1 else _Each(writers)
    return Tracker(kind=kind, folder=folder, per_rank=per_rank, writer=writer)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # a module without a spec (already imported oddly): take it as there
        return True


def _scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            msg = f"metric {name!r} is a tensor of shape {list(value.shape)}; log a scalar (reduce it first)"
            raise ArgumentValueError(msg)
        return float(value.detach().item())
    if isinstance(value, bool) or not isinstance(value, int | float):
        msg = f"metric {name!r} must be a number or a one-element tensor, got {type(value).__name__}"
        raise ArgumentError(msg)
    return float(value)


def log(
    dist: DistState,
    tracker: Tracker,
    step: int,
    metrics: Mapping[str, Any],
    *,
    reduce: str | None = None,
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
    if step < 0:
        msg = f"step must be >= 0, got {step!r}"
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
            raise StorageError(msg) from error


def end_training(dist: DistState, tracker: Tracker) -> None:
    """Close ``tracker``'s writer (Accelerate's ``end_training``); a no-op where it writes nothing.

    Example:
        >>> import tempfile, faccel
        >>> dist = faccel.detect({})
        >>> faccel.end_training(dist, faccel.init_tracker(dist, tempfile.mkdtemp(), kind="csv"))
    """
    tracker.__exit__(None, None, None)


def read_metrics(run: str | os.PathLike[str]) -> dict[str, list[tuple[int, float]]]:
    """Metric name -> ``(step, value)`` pairs from a run's ``metrics.jsonl`` (or the file itself).

    Example:
        >>> import pathlib, tempfile, faccel
        >>> dist, run = faccel.detect({}), pathlib.Path(tempfile.mkdtemp())
        >>> with faccel.init_tracker(dist, run) as tracker:
        ...     for step in range(3):
        ...         faccel.log(dist, tracker, step, {"loss": 1.0 / (step + 1)})
        >>> read_metrics(run)["loss"]
        [(0, 1.0), (1, 0.5), (2, 0.3333333333333333)]
    """
    path = Path(run)
    if path.is_dir():
        path = path / METRICS_FILE
    curves: dict[str, list[tuple[int, float]]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        for name, value in record["metrics"].items():
            curves.setdefault(name, []).append((int(record["step"]), float(value)))
    return curves


def plot(run: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draw every metric of a JSONL run against its step into one PNG; returns its path.

    Needs matplotlib. The default output is ``metrics.png`` beside ``metrics.jsonl``.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    curves = read_metrics(run)
    if not curves:
        msg = f"{run} holds no metrics to plot"
        raise ArgumentValueError(msg)
    figure = Figure(figsize=(5 * min(len(curves), 3), 3.5 * ((len(curves) + 2) // 3)), dpi=100)
    FigureCanvasAgg(figure)
    for index, (name, points) in enumerate(sorted(curves.items()), start=1):
        axes = figure.add_subplot((len(curves) + 2) // 3, min(len(curves), 3), index)
        steps, values = zip(*points, strict=True)
        axes.plot(steps, values)
        axes.set_title(name)
        axes.set_xlabel("step")
        axes.grid(alpha=0.3)
    figure.tight_layout()
    target = (
        Path(out)
        if out is not None
        else (Path(run) if Path(run).is_dir() else Path(run).parent) / "metrics.png"
    )
    figure.savefig(target)
    return target
