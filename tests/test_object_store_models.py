"""Saved models, stray objects and trackers' folders on object storage, against a real S3 server.

``save_model`` to ``s3://`` and ``load_model`` from it (both layouts; FSDP2 by
rows, each rank reading only its own rows by ranged GETs), and the same bytes
load with ``from_pretrained`` once copied down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.object_store import S3, moto_server_fixture, s3_fixture  # noqa: F401 - the fixtures

pytest.importorskip("s3fs")
transformers = pytest.importorskip("transformers", reason="needs transformers (in the test extra)")


def _gpt2(seed: int) -> Any:
    from tests.distributed.save_model_workers import tiny_gpt2

    return tiny_gpt2(seed)


@pytest.mark.parametrize("max_shard_size", ["5GB", 30_000])
def test_load_model_reads_a_model_saved_to_s3_and_from_pretrained_its_copy(
    s3: S3, tmp_path: Path, max_shard_size: Any
) -> None:
    import faccel
    from tests.distributed.save_model_workers import tokens

    dist, model = faccel.detect({}), _gpt2(0)
    url = f"{s3.url}/gpt2-{max_shard_size}"
    faccel.save_model(dist, model, url, max_shard_size=max_shard_size)
    fresh = _gpt2(1)
    assert faccel.load_model(dist, fresh, url) == ((), ())
    saved, loaded = model.state_dict(), fresh.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    s3.fs().get(f"{url.removeprefix('s3://')}/", str(tmp_path / "down"), recursive=True)
    names = sorted(p.name for p in (tmp_path / "down").iterdir())
    assert ("model.safetensors.index.json" in names) == (max_shard_size != "5GB")
    copied = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "down").eval()
    with torch.no_grad():
        assert torch.equal(copied(tokens()).logits, model(tokens()).logits)


def test_load_model_from_s3_refuses_a_mismatch_and_a_truncated_object(s3: S3) -> None:
    import faccel

    dist, model = faccel.detect({}), torch.nn.Linear(4, 3)
    url = f"{s3.url}/linear"
    faccel.save_model(dist, model, url)
    with pytest.raises(faccel.errors.CheckpointError, match=r"has shape \[3, 4\] in the file, \[3, 5\]"):
        faccel.load_model(dist, torch.nn.Linear(5, 3), url)
    fs, key = s3.fs(), f"{url.removeprefix('s3://')}/model.safetensors"
    fs.pipe_file(key, fs.cat_file(key)[:-4])
    fresh = torch.nn.Linear(4, 3)
    before = fresh.weight.detach().clone()
    with pytest.raises(faccel.errors.CheckpointError, match=r"s3://.*/linear/model.safetensors.*truncated"):
        faccel.load_model(dist, fresh, url)
    assert torch.equal(fresh.weight, before)
    with pytest.raises(faccel.errors.CheckpointError, match=r"neither model.safetensors"):
        faccel.load_model(dist, fresh, f"{s3.url}/nothing-here")


def test_load_model_reads_a_legacy_bin_from_s3(s3: S3) -> None:
    import io

    import faccel

    model = torch.nn.Linear(4, 3)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    s3.fs().pipe_file(f"{s3.url.removeprefix('s3://')}/bin/pytorch_model.bin", buffer.getvalue())
    fresh = torch.nn.Linear(4, 3)
    faccel.load_model(faccel.detect({}), fresh, f"{s3.url}/bin")
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_fsdp2_ranks_load_their_own_rows_from_s3(s3: S3) -> None:
    """2 gloo ranks: save_model to s3:// in shards, load_model from it by rows: bitwise back, and each
    rank read about half of the tensor bytes (its rows, plus the headers)."""
    from tests.distributed import harness
    from tests.distributed import object_model_workers as omw

    results = harness.run(omw.rows_from_s3, world_size=2, timeout=240, env=dict(s3.env), url=f"{s3.url}/fsdp")
    for result in results:
        assert result["back"] and result["logits"], result
        assert result["whole"] * 0.4 < result["read"] < result["whole"] * 0.6, result


def _state(step: int, seed: int = 0) -> Any:
    import attrs

    import faccel

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    return attrs.evolve(state, step=step)


def _put(root: str, name: str, data: bytes, s3: S3 | None) -> None:
    if s3 is None:
        path = Path(root) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    else:
        s3.fs().pipe_file(f"{root.removeprefix('s3://')}/{name}", data)


_STRAYS = ["notes.txt", "shard-00007.safetensors", "sub/x.bin"]
# Every case on the disk (fast); on S3 (a few seconds each) a stray of each kind once.
_CASES = [
    *(("disk", sharded, stray) for sharded in (False, True) for stray in _STRAYS),
    ("s3", False, "notes.txt"),
    ("s3", True, "shard-00007.safetensors"),
    ("s3", False, "sub/x.bin"),
]


@pytest.mark.parametrize(("where", "sharded", "stray"), _CASES)
def test_an_extra_object_in_a_committed_checkpoint_is_a_named_error(
    request: pytest.FixtureRequest, tmp_path: Path, where: str, sharded: bool, stray: str
) -> None:
    """An object the manifest does not list is damage, as a missing one is: the folder is refused by
    name; from a root, the newest checkpoint that passes is restored (with a warning). An uncommitted
    prefix with leftovers of a write in progress trips nothing."""
    import faccel

    s3 = request.getfixturevalue("s3") if where == "s3" else None
    root = f"{s3.url}/run" if s3 is not None else str(tmp_path / "run")
    dist = faccel.detect({})
    faccel.checkpoint(dist, _state(1), root, sharded=sharded)
    faccel.checkpoint(dist, _state(2, seed=1), root, sharded=sharded)
    # A write in progress: on S3 its objects under their final prefix, on a disk its staging folder.
    progress = "step-000000000003" if s3 is not None else ".tmp-step-000000000003"
    _put(root, f"{progress}/model.safetensors", b"a write in progress", s3)
    assert faccel.restore(dist, _state(0, seed=2), root).step == 2  # no warning: nothing broken
    _put(root, f"step-000000000002/{stray}", b"stray", s3)
    target = _state(0, seed=2)
    before = target.model.weight.detach().clone()
    with pytest.raises(faccel.errors.CheckpointError, match=rf"step-000000000002.*{stray.split('/')[0]}"):
        faccel.restore(dist, target, f"{root}/step-000000000002")
    assert torch.equal(target.model.weight, before)
    with pytest.warns(faccel.errors.CheckpointWarning, match=r"passed over.*step-000000000002.*not list"):
        restored = faccel.restore(dist, target, root)
    assert restored.step == 1


@pytest.mark.parametrize("kind", ["jsonl", "csv"])
def test_a_tracker_logs_to_s3_and_a_resumed_run_appends(
    s3: S3, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log object is rewritten whole: at the first record, then at most every FLUSH_SECONDS, and
    at the close; a second tracker on the same logdir (a resumed run) appends to what is there."""
    import json

    import faccel
    from faccel._report import _tracking
    from faccel._report._metrics_file import read_metrics

    monkeypatch.setattr(_tracking, "FLUSH_SECONDS", 10**6)  # only the first record and the close flush
    dist, fs = faccel.detect({}), s3.fs()
    name = "metrics.jsonl" if kind == "jsonl" else "metrics.csv"
    key = f"{s3.url.removeprefix('s3://')}/logs/p/r/{name}"

    def lines() -> list[str]:
        fs.invalidate_cache()
        return fs.cat_file(key).decode().splitlines()

    tracker = faccel.init_tracker(
        dist, f"{s3.url}/logs", kind=kind, config={"lr": 0.1}, project="p", run_name="r"
    )
    assert tracker.folder == f"{s3.url}/logs/p/r"
    faccel.log(dist, tracker, 1, {"loss": 0.5})
    assert len(lines()) == (1 if kind == "jsonl" else 2)  # the first record at once (csv: and the header)
    faccel.log(dist, tracker, 2, {"loss": 0.25})
    assert len(lines()) == (1 if kind == "jsonl" else 2)  # held until the next flush
    faccel.end_training(dist, tracker)
    with faccel.init_tracker(dist, f"{s3.url}/logs", kind=kind, project="p", run_name="r") as again:
        faccel.log(dist, again, 3, {"loss": 0.125})
    got = lines()
    if kind == "jsonl":
        assert [json.loads(line)["metrics"]["loss"] for line in got] == [0.5, 0.25, 0.125]
        curves = read_metrics(f"{s3.url}/logs/p/r")  # read back from the store too
        assert curves == {"loss": [(1, 0.5), (2, 0.25), (3, 0.125)]}
        with pytest.raises(faccel.errors.ArgumentValueError, match=r"metrics.jsonl.*missing"):
            read_metrics(f"{s3.url}/logs/nothing")
    else:
        assert got[0] == "step,time,source,metric,value" and [r.split(",")[0] for r in got[1:]] == [
            "1",
            "2",
            "3",
        ]
    fs.invalidate_cache()
    assert json.loads(fs.cat_file(f"{s3.url.removeprefix('s3://')}/logs/p/r/config.json")) == {}


@pytest.mark.parametrize("kind", ["tensorboard", "all"])
def test_other_trackers_refuse_a_url_logdir_by_name(kind: str) -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentValueError, match=rf"kind='{kind}' writes local files only"):
        faccel.init_tracker(faccel.detect({}), "s3://bucket/logs", kind=kind)  # type: ignore[arg-type]


def test_profile_and_plot_refuse_a_url_and_say_to_copy_it_down(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import faccel
    from faccel.__main__ import main

    assert main(["plot", "s3://bucket/run"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ArgumentValueError:") and "is a URL (s3://...)" in err and "copy" in err, err
    with (
        pytest.raises(faccel.errors.ArgumentValueError, match=r"profile's trace_dir is a URL.*copy"),
        faccel.profile(faccel.detect({}), "s3://bucket/traces"),
    ):
        pass
    assert not any(tmp_path.iterdir()) and not Path("s3:").exists()


def test_consolidate_and_convert_write_to_any_store_and_read_from_it(
    s3: S3, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m faccel consolidate CKPT s3://bucket/out`` from a checkpoint on S3, and ``convert``
    from a disk to S3: the same tensors at the far end (tests/test_storage_seam.py runs both
    functions on every store)."""
    import faccel
    from faccel.__main__ import main

    dist, state = faccel.detect({}), _state(3)
    faccel.checkpoint(dist, state, f"{s3.url}/run")
    assert main(["consolidate", f"{s3.url}/run", f"{s3.url}/out"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.strip() == f"wrote model.safetensors to {s3.url}/out"
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(state.model.state_dict(), legacy / "pytorch_model.bin")
    (legacy / "config.json").write_text("{}")
    assert main(["convert", str(legacy), f"{s3.url}/converted"]) == 0, capsys.readouterr().err
    assert "config.json, model.safetensors" in capsys.readouterr().out
    for out in ("out", "converted"):
        fresh = torch.nn.Linear(4, 3)
        assert faccel.load_model(dist, fresh, f"{s3.url}/{out}") == ((), ())
        assert torch.equal(fresh.weight, state.model.weight) and torch.equal(fresh.bias, state.model.bias)


def test_a_failed_log_upload_is_a_storage_error_and_the_next_flush_keeps_every_record(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    import json

    import faccel
    from faccel._report import _tracking
    from faccel._storage._objects import ObjectStore

    monkeypatch.setattr(_tracking, "FLUSH_SECONDS", 0.0)  # every record flushed at once
    dist = faccel.detect({})
    tracker = faccel.init_tracker(dist, f"{s3.url}/logs")
    faccel.log(dist, tracker, 1, {"loss": 1.0})
    real = ObjectStore.replace

    def down(self: ObjectStore, key: str, chunks: Any) -> Any:
        raise faccel.errors.CheckpointError(f"{self.display(key)}: uploading failed 6 times (injected)")

    monkeypatch.setattr(ObjectStore, "replace", down)
    with pytest.raises(
        faccel.errors.StorageError, match=r"could not upload the log.*step 2.*uploading failed.*kept"
    ):
        faccel.log(dist, tracker, 2, {"loss": 2.0})
    monkeypatch.setattr(ObjectStore, "replace", real)
    faccel.log(dist, tracker, 3, {"loss": 3.0})
    faccel.end_training(dist, tracker)
    fs = s3.fs()
    text = fs.cat_file(f"{s3.url.removeprefix('s3://')}/logs/metrics.jsonl").decode()
    assert [json.loads(line)["step"] for line in text.splitlines()] == [1, 2, 3]
