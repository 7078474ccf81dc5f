"""Checkpoints on object storage, against a real S3 server (moto's, on 127.0.0.1): the disk's laws.

Round trip (whole and sharded), the same bytes on both stores (copied either
way, it restores), only committed checkpoints seen, orphans removed by the
next checkpoint, ``keep=``, one writer per root, validation (missing,
truncated, swapped, extra objects), transient errors retried then named,
credentials never shown, and a bounded kill loop (the long proof is
``scripts/prove_object_store.py``). Without the extra, a URL root is refused
by name.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from tests.distributed import checkpoint_workers as cw
from tests.object_store import S3, moto_server_fixture, s3_fixture  # noqa: F401 - the fixtures
from tests.strategies import checkpoint_specs, plain_trees

pytest.importorskip("s3fs")


def _state(step: int, *, seed: int = 0) -> Any:
    import faccel

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    state = faccel.TrainState.create(model=model, optimizer=optimizer, extras={"note": f"step {step}"})
    return attrs.evolve(state, step=step)


def _fresh() -> Any:
    return _state(0, seed=99)


def _same(a: Any, b: Any) -> bool:
    left, right = a.model.state_dict(), b.model.state_dict()
    return all(torch.equal(left[k], right[k]) for k in left)


@pytest.mark.parametrize("sharded", [False, True])
def test_a_checkpoint_round_trips_through_s3_bitwise(s3: S3, sharded: bool) -> None:
    import faccel

    dist, state = faccel.detect({}), _state(3)
    folder = faccel.checkpoint(dist, state, f"{s3.url}/run", sharded=sharded)
    assert folder == f"{s3.url}/run/step-000000000003"
    assert faccel.latest_checkpoint(f"{s3.url}/run") == folder
    target = _fresh()
    restored = faccel.restore(dist, target, f"{s3.url}/run")
    assert restored.step == 3 and restored.extras == {"note": "step 3"} and _same(restored, state)
    cw.assert_same(target.optimizer.state_dict(), state.optimizer.state_dict())


@given(spec=checkpoint_specs(), values=plain_trees)
@settings(
    max_examples=4,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.nested_given],
)
def test_the_restore_law_holds_on_s3(s3: S3, spec: dict, values: Any) -> None:
    """restore(checkpoint(s)) == s on the object store, for any checkpointable state."""
    import faccel
    from tests.test_checkpoint import _with_extras

    dist = faccel.detect({})
    state = _with_extras(spec, 0, values)
    model, optimizer, loader = faccel.prepare(dist, state.model, state.optimizer, cw.data(spec))
    cw.seed_generators(0, 5)
    state = cw.train(dist, attrs.evolve(state, model=model, optimizer=optimizer), loader, until=2)
    saved = cw.observe(state)
    root = f"{s3.url}/law-{os.urandom(4).hex()}"
    faccel.checkpoint(dist, state, root)
    cw.seed_generators(0, 77)
    restored = faccel.restore(dist, _with_extras(spec, 1, None, placeholders=True), root)
    cw.assert_same(cw.observe(restored), saved)


@pytest.mark.parametrize("sharded", [False, True])
def test_the_same_bytes_restore_after_a_copy_either_way(s3: S3, tmp_path: Path, sharded: bool) -> None:
    import faccel

    dist, state, fs = faccel.detect({}), _state(4), s3.fs()
    faccel.checkpoint(dist, state, f"{s3.url}/up", sharded=sharded)
    bucket = s3.url.removeprefix("s3://")
    fs.get(f"{bucket}/up/", str(tmp_path / "down"), recursive=True)
    assert _same(faccel.restore(dist, _fresh(), tmp_path / "down"), state)
    # And a checkpoint written to the disk, copied up, restores from the store.
    faccel.checkpoint(dist, attrs.evolve(state, step=5), tmp_path / "disk", sharded=sharded)
    fs.put(str(tmp_path / "disk" / "step-000000000005"), f"{bucket}/copied/", recursive=True)
    restored = faccel.restore(dist, _fresh(), f"{s3.url}/copied")
    assert restored.step == 5 and _same(restored, state)


def test_only_committed_checkpoints_count_and_orphans_go_with_the_next_one(s3: S3) -> None:
    import faccel

    dist, state, fs = faccel.detect({}), _state(1), s3.fs()
    root = f"{s3.url}/run"
    bucket_root = root.removeprefix("s3://")
    faccel.checkpoint(dist, state, root)
    # A writer killed before its manifest: data objects of step 2, no manifest.
    fs.pipe_file(f"{bucket_root}/step-000000000002/model.safetensors", b"partial")
    assert faccel.latest_checkpoint(root) == f"{root}/step-000000000001"
    assert faccel.restore(dist, _fresh(), root).step == 1  # no warning: not committed, not broken
    faccel.checkpoint(dist, attrs.evolve(state, step=3), root, keep=2)
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(bucket_root)) == [
        "step-000000000001",
        "step-000000000003",
    ]
    faccel.checkpoint(dist, attrs.evolve(state, step=4), root, keep=1)  # deletes after the commit
    fs.invalidate_cache()
    assert [p.rsplit("/", 1)[-1] for p in fs.ls(bucket_root)] == ["step-000000000004"]


def test_a_second_writer_is_refused_and_a_committed_step_is_never_overwritten(s3: S3) -> None:
    import faccel
    from faccel._storage._roots import spot_of

    dist, state = faccel.detect({}), _state(1)
    root = f"{s3.url}/run"
    faccel.checkpoint(dist, state, root)
    spot = spot_of(root)
    with (
        spot.store.lock(spot.key),  # another live writer holds the lease
        pytest.raises(faccel.errors.CheckpointError, match="another process is writing"),
    ):
        faccel.checkpoint(dist, attrs.evolve(state, step=2), root)
    with pytest.raises(faccel.errors.CheckpointError, match="already exists"):
        faccel.checkpoint(dist, state, root)
    # The commit is a conditional write: a manifest that appeared meanwhile wins, this one is refused.
    manifest = spot / "step-000000000001" / "manifest.json"
    before = manifest.read(None, where="m")[0]
    with pytest.raises(faccel.errors.CheckpointError, match="another writer committed"):
        spot.store.commit(
            manifest.parent.key,
            manifest.parent.key,
            "manifest.json",
            [b"{}"],
            check=lambda k, committed: None,
        )
    assert torch.equal(manifest.read(None, where="m")[0], before)


def _tamper(s3: S3, root: str, how: str, sharded: bool) -> None:
    fs = s3.fs()
    folder = f"{root.removeprefix('s3://')}/step-000000000001"
    victim = f"{folder}/{'shard-00000.safetensors' if sharded else 'model.safetensors'}"
    data = fs.cat_file(victim)
    if how == "missing":
        fs.rm(victim)
    elif how == "truncated":
        fs.pipe_file(victim, data[:-3])
    elif how == "altered":
        fs.pipe_file(victim, data[:-1] + bytes([data[-1] ^ 1]))
    elif how == "swapped":
        fs.pipe_file(
            victim, fs.cat_file(f"{root.removeprefix('s3://')}/step-000000000002/{victim.rsplit('/', 1)[1]}")
        )


@pytest.mark.parametrize("how", ["missing", "truncated", "altered", "swapped"])
@pytest.mark.parametrize("sharded", [False, True])
def test_a_damaged_object_is_a_named_error_and_nothing_is_touched(s3: S3, how: str, sharded: bool) -> None:
    import faccel

    dist = faccel.detect({})
    root = f"{s3.url}/run-{how}"
    faccel.checkpoint(dist, _state(1), root, sharded=sharded)
    faccel.checkpoint(dist, _state(2, seed=5), f"{s3.url}/run-{how}", sharded=sharded)
    _tamper(s3, root, how, sharded)
    target = _fresh()
    before = [p.detach().clone() for p in target.model.parameters()]
    with pytest.raises(faccel.errors.CheckpointError, match=r"step-000000000001"):
        faccel.restore(dist, target, f"{root}/step-000000000001")
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters(), strict=True))


def test_transient_errors_are_retried_then_named_and_lose_nothing_committed(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    import faccel
    from faccel._storage import _objects

    dist, state = faccel.detect({}), _state(1)
    root = f"{s3.url}/run"
    faccel.checkpoint(dist, state, root)
    monkeypatch.setattr(_objects, "_FIRST_WAIT", 0.001)
    from faccel._storage._roots import spot_of

    fs = spot_of(root).store.fs  # fsspec's cached instance: the one faccel uses
    real_pipe = fs.pipe_file
    failures = {"left": 3}

    def flaky(*args: Any, **kwargs: Any) -> Any:  # a burst of 503 SlowDown answers
        if failures["left"] > 0:
            failures["left"] -= 1
            raise OSError(503, "SlowDown: please reduce your request rate")
        return real_pipe(*args, **kwargs)

    monkeypatch.setattr(fs, "pipe_file", flaky)
    faccel.checkpoint(dist, attrs.evolve(state, step=2), root)  # a burst shorter than the retries
    failures["left"] = 10**6  # the store stays down: the named error, after a bounded number of tries
    with pytest.raises(
        faccel.errors.CheckpointError, match=r"failed 6 times with a transient error"
    ) as caught:
        faccel.checkpoint(dist, attrs.evolve(state, step=3), root)
    assert "testing-secret" not in str(caught.value) and "testing-key-id" not in str(caught.value)
    monkeypatch.setattr(fs, "pipe_file", real_pipe)
    restored = faccel.restore(dist, _fresh(), root)
    assert restored.step == 2 and _same(restored, state)


def test_the_server_stopped_mid_upload_gives_the_named_error(s3: S3, monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that goes away for good: the writer's error names the object; nothing committed changes."""
    from moto.server import ThreadedMotoServer

    import faccel
    from faccel._storage import _objects

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{host}:{port}")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://{host}:{port}")
    monkeypatch.setattr(_objects, "_FIRST_WAIT", 0.001)
    monkeypatch.setattr(_objects, "ATTEMPTS", 2)
    import fsspec
    import s3fs

    # s3fs and botocore retry a refused connection themselves, with sleeps of their own: one try
    # each here, so that the test measures faccel's bounded retries, not the client's.
    monkeypatch.setattr(s3fs.S3FileSystem, "retries", 1)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")

    fsspec.filesystem("s3").clear_instance_cache()
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir("stopped")
    dist, state = faccel.detect({}), _state(1)
    faccel.checkpoint(dist, state, "s3://stopped/run")
    real = _objects.ObjectStore._upload

    def stop_then_upload(self: Any, key: str, *args: Any, **kwargs: Any) -> None:
        if key.endswith("optimizer.safetensors"):
            server.stop()
        real(self, key, *args, **kwargs)

    monkeypatch.setattr(_objects.ObjectStore, "_upload", stop_then_upload)
    with pytest.raises(faccel.errors.CheckpointError, match=r"s3://stopped/run/step-000000000002"):
        faccel.checkpoint(dist, attrs.evolve(state, step=2), "s3://stopped/run")
    # Back up (a new server on the same data is not possible with moto: the committed step is
    # checked through a disk copy in the other tests); here: the error named the object, no hang.


@pytest.mark.parametrize(("how", "sharded"), [("503", True), ("unreachable", False), ("stopped", True)])
def test_a_fault_at_one_of_two_ranks_is_named_on_both_and_loses_nothing_committed(
    s3: S3, how: str, sharded: bool
) -> None:
    """During a two-rank checkpoint one rank's uploads fail for good (a 503 burst longer than the
    retries, its server gone before its first request, or gone mid-upload: its connections cut
    after its first object of the step, then refused): both ranks raise the named CheckpointError
    (no hang: the harness's timeout), and the committed step 1 restores whole at both ranks."""
    from tests.distributed import harness
    from tests.distributed import object_store_workers as ow

    results = harness.run(
        ow.fault_on_one_rank,
        world_size=2,
        timeout=180,
        env=dict(s3.env),
        root=f"{s3.url}/f",
        how=how,
        sharded=sharded,
    )
    for result in results:
        assert result["raised"] is not None, results
        assert result["raised"]["type"] == "faccel.errors.CheckpointError", results
        assert "testing-secret" not in result["raised"]["message"], results
        assert [result["restored"], result["marks"], result["extras"]] == [1, [1.0], 1], results
    if how == "stopped":  # rank 1's own error names the object it was uploading when the server went
        assert results[1]["uploaded_before_the_stop"] is not None, results
        assert "step-000000000002/" in results[1]["raised"]["message"], results


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
@pytest.mark.parametrize("stage", [2, 3])
def test_a_deepspeed_zero_run_checkpoints_into_s3_and_resumes_bitwise(s3: S3, stage: int) -> None:
    """ZeRO-2 (blocking) and ZeRO-3 (blocking=False: uploaded by the background thread) on 2 gloo
    ranks checkpoint at step 6 into s3://, train on to 9; a fresh engine restored from the bucket
    trains to 9 too: masters, moments and final weights bitwise equal to the uninterrupted run."""
    from tests.distributed import harness
    from tests.distributed import object_store_workers as ow

    results = harness.run(
        ow.deepspeed_stop_and_resume,
        world_size=2,
        timeout=300,
        env=dict(s3.env),
        root=f"{s3.url}/zero",
        stage=stage,
    )
    for result in results:
        assert result["restored_step"] == 6 and result["ended_step"] == 9
        assert result["after_restore"] == result["saved"]  # ZeRO's masters and moments, bitwise
        assert result["resumed"] == result["uninterrupted"]  # bitwise (floats compared exactly)
        assert result["counters"] == [9, 9]
        assert result["files"] == [
            "extras.safetensors",
            "manifest.json",
            "model.safetensors",
            "optimizer.safetensors",
            "rng-00000.json",
            "rng-00001.json",
            "state.json",
        ]


def test_credentials_never_appear_in_reprs_or_errors(s3: S3) -> None:
    import faccel
    from faccel._storage._roots import spot_of

    spot = spot_of(f"{s3.url}/run")
    assert "testing" not in repr(spot) and "testing" not in repr(spot.store) and "testing" not in str(spot)
    with pytest.raises(faccel.errors.ArgumentValueError) as caught:
        faccel.restore(faccel.detect({}), _fresh(), "s3://user:hunter2@nobucket/run")
    assert "hunter2" not in str(caught.value)
    with pytest.raises(faccel.errors.CheckpointError, match=r"refused|no checkpoint") as refused:
        faccel.restore(faccel.detect({}), _fresh(), "s3://no-such-bucket-here/run")
    assert "testing" not in str(refused.value)


def test_a_url_root_without_the_extra_is_refused_by_name() -> None:
    code = (
        "import sys; sys.modules['s3fs'] = None\n"
        "import faccel, torch\n"
        "m = torch.nn.Linear(1, 1)\n"
        "s = faccel.TrainState.create(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.1))\n"
        "try:\n"
        "    faccel.checkpoint(faccel.detect({}), s, 's3://bucket/run')\n"
        "except faccel.errors.MissingExtraError as e:\n"
        "    print('REFUSED', e)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert "REFUSED" in out.stdout, out.stderr[-2000:]
    assert "pip install 'faccel[s3]'" in out.stdout
    with tempfile.TemporaryDirectory() as root:
        assert not any(Path(root).iterdir())


@pytest.mark.parametrize("sharded", [False, True])
def test_writers_killed_at_random_moments_leave_a_whole_checkpoint_on_s3(s3: S3, sharded: bool) -> None:
    """The bounded kill loop (scripts/prove_object_store.py runs hundreds): every restore is whole."""
    from tests.distributed import harness
    from tests.distributed import object_store_workers as ow

    (result,) = harness.run(
        ow.crash_trials,
        world_size=1,
        timeout=300,
        env=dict(s3.env),
        root=f"{s3.url}/kills",
        trials=6,
        delay_in_writes=2.0,
        seed=1,
        sharded=sharded,
    )
    outcomes = result["outcomes"]
    assert len(outcomes) == 6
    assert all(checked >= committed for committed, checked in outcomes)


@pytest.mark.parametrize("sharded", [False, True])
def test_two_rank_writers_killed_at_random_moments_leave_whole_checkpoints_on_s3(
    s3: S3, sharded: bool
) -> None:
    """The bounded two-rank kill loop (scripts/prove_object_store.py runs hundreds): one rank or
    both SIGKILLed mid-checkpoint; every restore is whole, no committed checkpoint is damaged,
    and the next successful checkpoint removes the orphans."""
    from tests.distributed import harness
    from tests.distributed import object_store_workers as ow

    (result,) = harness.run(
        ow.two_rank_crash_trials,
        world_size=1,
        timeout=300,
        env=dict(s3.env),
        root=f"{s3.url}/kills2",
        trials=3,
        delay_in_writes=2.0,
        seed=3,
        sharded=sharded,
    )
    outcomes = result["outcomes"]
    assert len(outcomes) == 3
    assert all(committed <= restored <= committed + 1 for committed, restored, _ in outcomes)
    assert result["orphan_cleaned"]  # the last kill left an uncommitted step; the next write removed it
    last = result["latest"]
    assert [name for name in result["left"] if name.startswith("step-")] == [
        f"step-{last:012d}",
        f"step-{last + 2:012d}",
    ]


@pytest.mark.parametrize(("strategy", "sharded"), [("ddp", False), ("fsdp", True)])
def test_two_gloo_ranks_round_trip_on_s3_and_restore_at_one_and_three(
    s3: S3, strategy: str, sharded: bool
) -> None:
    """Each rank uploads its own objects; restores at 1 and 3 ranks give back every tensor bitwise."""
    from tests.distributed import harness
    from tests.distributed import object_store_workers as ow

    root, env = f"{s3.url}/{strategy}", dict(s3.env)
    saved = harness.run(ow.save, world_size=2, env=env, root=root, strategy=strategy, sharded=sharded)
    assert saved[0]["state"] == saved[1]["state"]
    shards = [name for name in saved[0]["objects"] if name.startswith("shard-")]
    assert shards == (["shard-00000.safetensors", "shard-00001.safetensors"] if sharded else [])
    for world in (1, 3):  # another world size each way (2 ranks: the S3 round trips above)
        loaded = harness.run(ow.load, world_size=world, env=env, root=root, strategy=strategy)
        assert all("error" not in r for r in loaded), loaded
        assert all(r["state"] == saved[0]["state"] for r in loaded), world


def test_a_background_checkpoint_uploads_on_its_thread_and_commits(s3: S3) -> None:
    import faccel
    from faccel._checkpoint._background import wait

    dist, state = faccel.detect({}), _state(6)
    root = f"{s3.url}/background"
    folder = faccel.checkpoint(dist, state, root, blocking=False, sharded=True)
    wait(dist.runtime)
    assert faccel.latest_checkpoint(root) == folder
    restored = faccel.restore(dist, _fresh(), root)
    assert restored.step == 6 and _same(restored, state)


@pytest.mark.parametrize("sharded", [False, True])
def test_consolidate_reads_a_checkpoint_on_s3_into_the_same_weights(
    s3: S3, tmp_path: Path, sharded: bool
) -> None:
    from safetensors.torch import load_file

    import faccel

    dist, state = faccel.detect({}), _state(2)
    faccel.checkpoint(dist, state, f"{s3.url}/run", sharded=sharded)
    faccel.checkpoint(dist, state, tmp_path / "disk", sharded=sharded)
    from faccel._hf._consolidate import consolidate

    from_s3 = consolidate(f"{s3.url}/run", tmp_path / "from-s3")
    from_disk = consolidate(tmp_path / "disk", tmp_path / "from-disk")
    got, want = load_file(from_s3 / "model.safetensors"), load_file(from_disk / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


@pytest.mark.parametrize("max_shard_size", ["5GB", 300])
def test_save_model_writes_the_hugging_face_layout_to_s3(s3: S3, tmp_path: Path, max_shard_size: Any) -> None:
    """One file, or shards and an index committed last; copied down, load_model reads it back."""
    import faccel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    url = f"{s3.url}/model-{max_shard_size}"
    assert faccel.save_model(faccel.detect({}), model, url, max_shard_size=max_shard_size) == url
    s3.fs().get(f"{url.removeprefix('s3://')}/", str(tmp_path / "down"), recursive=True)
    names = sorted(p.name for p in (tmp_path / "down").iterdir())
    assert (
        names == ["model.safetensors"] if max_shard_size == "5GB" else "model.safetensors.index.json" in names
    )
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    faccel.load_model(faccel.detect({}), fresh, tmp_path / "down")
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("how", ["move", "delete"])
def test_a_named_checkpoint_and_a_rollback_on_s3(s3: S3, how: str) -> None:
    # Named checkpoints and restore(..., rollback=) go through the Store (a copy then a retire on S3).
    import faccel

    dist, state, fs = faccel.detect({}), _state(1), s3.fs()
    root = f"{s3.url}/run"
    bucket_root = root.removeprefix("s3://")
    for step in (1, 2, 3):
        faccel.checkpoint(dist, attrs.evolve(state, step=step), root)
    assert faccel.checkpoint(dist, attrs.evolve(state, step=2), root, name="best") == f"{root}/best"
    assert faccel.latest_checkpoint(root) == f"{root}/step-000000000003"
    assert faccel.restore(dist, _fresh(), f"{root}/best", into=f"{root}-best").step == 2
    with pytest.raises(faccel.errors.CheckpointError, match="also holds later checkpoints"):
        faccel.restore(dist, _fresh(), f"{root}/step-000000000001")
    restored = faccel.restore(dist, _fresh(), f"{root}/step-000000000001", rollback=how)
    assert restored.step == 1 and _same(restored, state)
    assert faccel.latest_checkpoint(root) == f"{root}/step-000000000001"
    fs.invalidate_cache()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(bucket_root))
    aside = ["abandoned-after-step-000000000001"] if how == "move" else []
    assert names == sorted(["best", "step-000000000001", *aside])
    if how == "move":
        moved = f"{root}/abandoned-after-step-000000000001/step-000000000003"
        assert faccel.restore(dist, _fresh(), moved, into=f"{root}-2").step == 3
