"""The tracking: any metric name, keyword dist, project folders, kind="all", hparams, a full disk."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import faccel

ROOT = Path(__file__).resolve().parent.parent


def test_a_metric_named_step_is_recorded_beside_the_records_own_step(tmp_path: Path) -> None:
    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path) as tracker:
        faccel.log(dist, tracker, 7, {"step": 3, "loss": 1.0, "time": 2.0, "source": 4.0})
    (record,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert (record["step"], record["source"]) == (7, "rank 0")
    assert record["metrics"] == {"step": 3.0, "loss": 1.0, "time": 2.0, "source": 4.0}
    assert faccel._report._tracking.read_metrics(tmp_path)["step"] == [(7, 3.0)]


def test_dist_by_keyword_is_accepted_and_a_missing_one_is_named(tmp_path: Path) -> None:
    # It wrote into the repository (does-not-matter/, then tracked by git); tmp_path instead.
    dist = faccel.detect({})
    with faccel.init_tracker(
        dist=dist, logdir=str(tmp_path / "does-not-matter"), kind="jsonl", per_rank=False
    ) as t:
        assert t.folder is not None
    with pytest.raises(faccel.errors.ArgumentError, match="takes the DistState first, got str"):
        faccel.init_tracker(dist="x", logdir="y")  # type: ignore[arg-type]
    with pytest.raises(faccel.errors.ArgumentError, match="got nothing"):
        faccel.init_tracker(logdir="y")  # type: ignore[call-arg]
    assert faccel.steps_per_epoch(dist=dist, loader=faccel.prepare(dist, _loader())) == 2


def _loader():  # type: ignore[no-untyped-def]
    import torch

    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(4.0)), batch_size=2)


def test_project_and_run_name_make_the_folder(tmp_path: Path) -> None:
    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path, project="clm", run_name="lr-0.1") as tracker:
        faccel.log(dist, tracker, 0, {"loss": 1.0})
    assert (tmp_path / "clm" / "lr-0.1" / "metrics.jsonl").exists()
    with faccel.init_tracker(dist, tmp_path, project="clm") as tracker:
        assert tracker.folder == tmp_path / "clm"
    with pytest.raises(faccel.errors.ArgumentValueError, match="one plain name"):
        faccel.init_tracker(dist, tmp_path, project="../elsewhere")


def test_kind_all_writes_jsonl_and_every_installed_back_end(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="kind='all' is checked here with tensorboard installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dist = faccel.detect({})
    with faccel.init_tracker(dist, tmp_path, kind="all", config={"lr": 0.1, "layers": [2]}) as tracker:
        assert tracker.kind == "all"
        faccel.log(dist, tracker, 1, {"loss": 0.5})
    assert faccel._report._tracking.read_metrics(tmp_path) == {"loss": [(1, 0.5)]}
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5)]


def test_tensorboard_records_the_config_as_hparams(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="the tensorboard back-end needs the tensorboard package")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    dist = faccel.detect({})
    with faccel.init_tracker(
        dist, tmp_path, kind="tensorboard", config={"lr": 0.1, "name": "a", "sizes": [1]}
    ):
        pass
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    data = plugin_data_pb2.HParamsPluginData.FromString(content)
    hparams = data.session_start_info.hparams
    assert hparams["lr"].number_value == 0.1
    assert hparams["name"].string_value == "a"
    assert hparams["sizes"].string_value == "[1]"


# A real file-size limit (RLIMIT_FSIZE) in a child process: the kernel refuses the write (EFBIG).
_FULL = textwrap.dedent(
    """
    import json, resource, signal, sys
    import faccel
    run = sys.argv[1]
    dist = faccel.detect({})
    tracker = faccel.init_tracker(dist, run, kind=sys.argv[2])
    faccel.log(dist, tracker, 0, {"loss": 1.0})
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of the signal that kills
    import os
    size = sum(os.path.getsize(os.path.join(run, f)) for f in os.listdir(run) if f.startswith("metrics"))
    resource.setrlimit(resource.RLIMIT_FSIZE, (size + 150, resource.RLIM_INFINITY))
    outcomes = []
    for step in range(1, 6):
        try:
            faccel.log(dist, tracker, step, {"a_long_metric_name_for_the_test": 0.123456789})
            outcomes.append("ok")
        except faccel.errors.StorageError as error:
            outcomes.append(type(error).__name__ + (" ok" if "left out whole" in str(error) else ""))
    faccel.end_training(dist, tracker)
    print(json.dumps(outcomes))
    """
)


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_full_disk_is_a_storage_error_and_the_file_stays_whole(tmp_path: Path, kind: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FULL, str(tmp_path), kind],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    assert done.returncode == 0, done.stderr
    outcomes = json.loads(done.stdout.splitlines()[-1])
    assert "ok" in outcomes[:1] and outcomes[-1] == "StorageError ok"
    if kind == "jsonl":
        lines = (tmp_path / "metrics.jsonl").read_text().splitlines(keepends=True)
        assert all(line.endswith("\n") for line in lines)
        assert len(lines) == 1 + outcomes.count("ok")
        assert [json.loads(line)["step"] for line in lines] == list(range(len(lines)))
    else:
        text = (tmp_path / "metrics.csv").read_text()
        assert text.endswith("\n") and len(text.splitlines()) == 2 + outcomes.count("ok")


def test_a_module_level_logger_reads_the_rank_when_it_logs(tmp_path: Path) -> None:
    script = textwrap.dedent(
        """
        import logging, sys
        import faccel
        logger = faccel.get_logger("app")  # at module level: no DistState yet
        logging.basicConfig(stream=sys.stdout, format="%(rank)s|%(message)s", level=logging.INFO)
        logger.info("main only")
        logger.info("every rank", main_process_only=False)
        """
    )
    outputs = []
    for rank in (0, 1):
        done = subprocess.run(
            [sys.executable, "-c", script],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "RANK": str(rank), "WORLD_SIZE": "2"},
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout.splitlines())
    assert outputs == [
        ["0|[rank 0/2] main only", "0|[rank 0/2] every rank"],
        ["1|[rank 1/2] every rank"],
    ]
