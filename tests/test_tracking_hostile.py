"""Hostile tracker names, configs, metrics and a full disk get a named error.

Before: ``ValueError: embedded null byte`` or ``OSError: File name too long`` for a name,
``ValueError: Circular reference detected``, ``RecursionError`` or ``ValueError: Exceeds the limit
(4300 digits)`` for a config, ``OverflowError`` for a metric of ``10**400``, and a raw
``OSError`` (ENOSPC) writing ``config.json`` on a full disk. Each refusal touches nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import faccel
from faccel.errors import ArgumentError, ArgumentValueError, StorageError
from tests.test_consolidate_races import _tiny_disk


def _circular() -> dict[str, Any]:
    config: dict[str, Any] = {"lr": 0.1}
    config["self"] = config
    return config


def _deep(depth: int) -> dict[str, Any]:
    config: dict[str, Any] = {}
    inner = config
    for _ in range(depth):
        inner["a"] = {}
        inner = inner["a"]
    return config


BAD_INIT: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("NUL in project", {"project": "a\x00b"}, ArgumentValueError, "project .* control character"),
    ("NUL in run_name", {"project": "p", "run_name": "a\x00b"}, ArgumentValueError, "run_name .* control"),
    ("NUL in run_name alone", {"run_name": "a\x00b"}, ArgumentValueError, "run_name .* control"),
    ("long project", {"project": "p" * 300}, ArgumentValueError, "project .* at most 255 bytes"),
    ("long run_name", {"project": "p", "run_name": "r" * 300}, ArgumentValueError, "at most 255 bytes"),
    ("project not a str", {"project": 7}, ArgumentError, "project"),
    ("circular config", {"config": _circular()}, ArgumentValueError, "config holds itself"),
    ("deep config", {"config": _deep(5000)}, ArgumentValueError, "nested deeper than 64"),
    ("huge integer", {"config": {"n": 10**5000}}, ArgumentValueError, "integer of 5001 digits"),
    (
        "non-str key",
        {"config": {"a": {("a", 1): 2}}},
        ArgumentValueError,
        r"config\['a'\] has the key \('a', 1\)",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "error", "pattern"), BAD_INIT, ids=[c[0] for c in BAD_INIT])
def test_init_tracker_names_a_hostile_name_or_config_and_touches_nothing(
    tmp_path: Path, case: str, kwargs: dict[str, Any], error: type[Exception], pattern: str
) -> None:
    with pytest.raises(error, match=pattern):
        faccel.init_tracker(faccel.detect({}), tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


BAD_LOG: list[tuple[str, Any, dict[str, Any], type[Exception], str]] = [
    ("metric of 10**400", 1, {"loss": 10**400}, ArgumentValueError, "metric 'loss' .* too large for a float"),
    ("complex tensor", 1, {"loss": torch.tensor(1 + 2j)}, ArgumentValueError, "complex"),
    ("NUL in a name", 1, {"lo\x00ss": 1.0}, ArgumentValueError, "control character"),
    ("empty name", 1, {"": 1.0}, ArgumentValueError, "metric name"),
    ("long name", 1, {"m" * 300: 1.0}, ArgumentValueError, "at most 255"),
    ("step of 10**400", 10**400, {"loss": 1.0}, ArgumentValueError, r"step must be .* < 2\*\*63"),
    ("bool step", True, {"loss": 1.0}, ArgumentError, "step must be an int"),
]


@pytest.mark.parametrize(
    ("case", "step", "metrics", "error", "pattern"), BAD_LOG, ids=[c[0] for c in BAD_LOG]
)
# (A float step or a name that is not a str: typeguard's own check in the suite; log checks them too.)
def test_log_names_a_hostile_metric_or_step_and_writes_nothing(
    tmp_path: Path, case: str, step: Any, metrics: dict[Any, Any], error: type[Exception], pattern: str
) -> None:
    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path) as tracker, pytest.raises(error, match=pattern):
        faccel.log(dist, tracker, step, metrics)
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_a_metric_named_step_time_or_source_is_allowed_in_every_file_back_end(tmp_path: Path) -> None:
    """docs/ecosystem.md said such a name was refused and allowed: it is allowed."""
    dist = faccel.detect({})
    for kind in ("jsonl", "csv"):
        with faccel.init_tracker(dist, tmp_path / kind, kind=kind) as tracker:
            faccel.log(dist, tracker, 7, {"step": 3, "time": 2.0, "source": 4.0})
    assert faccel._report._tracking.read_metrics(tmp_path / "jsonl")["step"] == [(7, 3.0)]
    rows = (tmp_path / "csv" / "metrics.csv").read_text().splitlines()
    assert rows[0] == "step,time,source,metric,value"
    assert [(r.split(",")[0], r.split(",")[3], r.split(",")[4]) for r in rows[1:]] == [
        ("7", "step", "3.0"),
        ("7", "time", "2.0"),
        ("7", "source", "4.0"),
    ]


def test_a_full_disk_at_init_tracker_is_a_storage_error_and_leaves_no_partial_config(tmp_path: Path) -> None:
    """A 16 KiB tmpfs cannot hold a 20 KB config.json: StorageError, no config.json, no stray file."""
    with _tiny_disk(tmp_path / "disk") as disk:
        with pytest.raises(StorageError, match=r"config\.json"):
            faccel.init_tracker(faccel.detect({}), disk / "run", config={"notes": "x" * 20_000})
        assert not (disk / "run").exists()
        assert list(disk.iterdir()) == []


def test_a_logdir_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(StorageError, match="could not"):
        faccel.init_tracker(faccel.detect({}), tmp_path / "file" / "run")


@pytest.mark.parametrize("logdir", ["s3:/bucket/logs", "s3:bucket/logs", " s3://bucket/logs"])
def test_a_mistyped_url_logdir_is_refused_and_no_local_folder_is_made(
    logdir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ArgumentValueError, match="is not a root faccel takes"):
        faccel.init_tracker(dist=faccel.detect({}), logdir=logdir)
    assert list(tmp_path.iterdir()) == []
