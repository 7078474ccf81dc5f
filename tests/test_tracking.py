"""Experiment tracking: what each back-end writes, read back with its own reader; whose values they are."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch

from tests.distributed import harness


def test_jsonl_records_say_whose_values_they_are_and_the_config_is_written_once(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path, config={"lr": 0.1, "layers": [2, 3]}) as tracker:
        for step in range(3):
            faccel.log(dist, tracker, step, {"loss": torch.tensor(1.0 / (step + 1)), "lr": 0.1})
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert {r["source"] for r in records} == {"rank 0"}
    assert [r["metrics"]["loss"] for r in records] == [1.0, 0.5, pytest.approx(1 / 3)]
    assert json.loads((tmp_path / "config.json").read_text()) == {"layers": [2, 3], "lr": 0.1}


def test_log_refuses_what_it_cannot_record_exactly(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path) as tracker:
        with pytest.raises(faccel.errors.ArgumentValueError, match="shape \\[3\\]; log a scalar"):
            faccel.log(dist, tracker, 0, {"loss": torch.ones(3)})
        with pytest.raises(faccel.errors.ArgumentError, match="must be a number"):
            faccel.log(dist, tracker, 0, {"loss": "low"})
        with pytest.raises(faccel.errors.ArgumentValueError, match="step must be >= 0"):
            faccel.log(dist, tracker, -1, {"loss": 1.0})
    with pytest.raises(faccel.errors.ArgumentValueError, match="kind must be one of"):
        faccel.init_tracker(dist, tmp_path, kind="neptune")
    assert not (tmp_path / "metrics.jsonl").read_text()  # nothing half-written


def test_csv_is_long_so_new_metrics_need_no_new_header(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path, kind="csv") as tracker:
        faccel.log(dist, tracker, 0, {"loss": 2.0})
        faccel.log(dist, tracker, 1, {"loss": 1.0, "accuracy": 0.5})
    rows = list(csv.DictReader((tmp_path / "metrics.csv").read_text().splitlines()))
    assert [(r["step"], r["metric"], float(r["value"])) for r in rows] == [
        ("0", "loss", 2.0),
        ("1", "loss", 1.0),
        ("1", "accuracy", 0.5),
    ]


def test_tensorboard_scalars_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard back-end needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import faccel

    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path, kind="tensorboard", config={"lr": 0.1}) as tracker:
        for step in range(4):
            faccel.log(dist, tracker, step, {"loss": 0.5**step})
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(s, 0.5**s) for s in range(4)]


def test_wandb_offline_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb", reason="the wandb back-end needs the wandb package (optional)")
    import faccel

    monkeypatch.setenv("WANDB_SILENT", "true")
    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path, kind="wandb", config={"lr": 0.1}) as tracker:
        faccel.log(dist, tracker, 0, {"loss": 1.0})
    assert list(tmp_path.glob("wandb/offline-run-*/run-*.wandb"))


# MLflow's own SQLAlchemy calls warn of deprecations in SQLAlchemy 2.1: theirs, not ours.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_mlflow_local_store(tmp_path: Path) -> None:
    pytest.importorskip("mlflow", reason="the mlflow back-end needs the mlflow package (optional)")
    from mlflow.tracking import MlflowClient

    import faccel

    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path, kind="mlflow", config={"lr": 0.1}) as tracker:
        for step in range(3):
            faccel.log(dist, tracker, step, {"loss": 1.0 / (step + 1)})
    client = MlflowClient(tracking_uri=f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}")
    run = client.search_runs([client.get_experiment_by_name("faccel").experiment_id])[0]
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(0, 1.0), (1, 0.5), (2, pytest.approx(1 / 3))]
    assert run.data.params == {"lr": "0.1"}


def _two_ranks(root: str) -> dict:
    import faccel

    dist = faccel.detect()
    own = torch.tensor(float(dist.rank + 1))
    with (
        faccel.init_tracker(dist, f"{root}/main") as main,
        faccel.init_tracker(dist, f"{root}/each", per_rank=True) as each,
    ):
        faccel.log(dist, main, 0, {"loss": own})  # rank 0's own value, written by rank 0 only
        faccel.log(dist, main, 1, {"loss": own}, reduce="mean")  # every rank calls: a collective
        faccel.log(dist, each, 0, {"loss": own})
    return {"writes": main.folder is not None}


def test_on_two_ranks_the_main_process_writes_and_says_whether_values_were_reduced(tmp_path: Path) -> None:
    results = harness.run(_two_ranks, world_size=2, root=str(tmp_path))
    assert [r["writes"] for r in results] == [True, False]
    records = [json.loads(line) for line in (tmp_path / "main" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["source"], r["metrics"]["loss"]) for r in records] == [
        ("rank 0", 1.0),
        ("mean over 2 ranks", 1.5),
    ]
    for rank in (0, 1):
        lines = (tmp_path / "each" / f"rank-{rank:05d}" / "metrics.jsonl").read_text().splitlines()
        (record,) = [json.loads(line) for line in lines]
        assert (record["source"], record["metrics"]["loss"]) == (f"rank {rank}", rank + 1.0)


def test_plot_draws_the_curves_to_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plotting needs matplotlib")
    import faccel
    from faccel._report._tracking import plot

    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path) as tracker:
        for step in range(5):
            faccel.log(dist, tracker, step, {"loss": 1.0 / (step + 1), "lr": 0.1 * 0.9**step})
    png = plot(tmp_path)
    assert png == tmp_path / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
