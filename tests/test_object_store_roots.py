"""Roots and leases on object storage that never lose or misplace a checkpoint (a real S3 server).

A root is parsed once, strictly: what looks like a URL but is not one, a chained fsspec URL,
credentials, an empty name between slashes or a query is refused by name, and nothing is
written anywhere. A root nested in another root's checkpoint name is refused, and the cleanup of
a write never committed deletes only objects a checkpoint's writers name, so a nested root of
an older run survives. A 4xx answer is not retried and not called throttling. A live writer's
lease is never taken over, in the two interleavings that once let a second writer in. A check
that fails after the manifest's write says the checkpoint is committed.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

import faccel
from faccel.errors import ArgumentValueError, CheckpointError
from tests.object_store import S3, moto_server_fixture, s3_fixture  # noqa: F401 - the fixtures

pytest.importorskip("s3fs")


def _state(step: int) -> Any:
    torch.manual_seed(step)
    model = torch.nn.Linear(4, 2)
    return attrs.evolve(faccel.TrainState.create(model=model, optimizer=None), step=step)


def _objects(s3: S3) -> list[str]:
    fs = s3.fs()
    return sorted(fs.find(s3.url.removeprefix("s3://")))


# (root, words the refusal must have): each one once wrote a local folder or failed obscurely.
_REFUSED = {
    "s3:/BUCKET/run": "first name has a ':'",
    "s3:BUCKET/run": "first name has a ':'",
    "s3 ://BUCKET/run": "first name has a ':'",
    " s3://BUCKET/run": "begins or ends with a space",
    "s3://BUCKET/run ": "begins or ends with a space",
    "simplecache::s3://BUCKET/run": "a chained fsspec URL",
    "filecache::s3://BUCKET/run": "a chained fsspec URL",
    "s3://testing-key-id:testing-secret@BUCKET/run": "credentials",
    "s3://BUCKET//double": "an empty name between two slashes",
    "s3://BUCKET/run?versionId=abc": "a query or a fragment",
}


def test_a_mistyped_or_chained_root_is_refused_by_name_and_nothing_is_written(
    s3: S3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # a mistyped URL once became a local folder here
    dist, state = faccel.detect({}), _state(1)
    bucket = s3.url.removeprefix("s3://")
    calls = {
        "checkpoint": lambda root: faccel.checkpoint(dist, state, root),
        "save_model": lambda root: faccel.save_model(dist, state.model, root),
        "latest_checkpoint": faccel.latest_checkpoint,
        "restore": lambda root: faccel.restore(dist, state, root),
    }
    for pattern, words in _REFUSED.items():
        root = pattern.replace("BUCKET", bucket)
        for call, run in calls.items():
            with pytest.raises(ArgumentValueError, match="is not a root faccel takes") as caught:
                run(root)
            assert words in str(caught.value), (call, root, str(caught.value))
            assert "testing-secret" not in str(caught.value) and "testing-key-id" not in str(caught.value)
    assert os.listdir(tmp_path) == [] and _objects(s3) == []
    # The escape for a local folder whose name has a ':' works.
    assert faccel.checkpoint(dist, state, "./s3:run").name == "step-000000000001"


def test_a_root_inside_a_checkpoint_name_is_refused_and_cleanup_spares_what_it_cannot_prove_its_own(
    s3: S3,
) -> None:
    dist, fs = faccel.detect({}), s3.fs()
    outer, bucket = f"{s3.url}/exp", s3.url.removeprefix("s3://")
    with pytest.raises(CheckpointError, match=r"inside a checkpoint folder's name \(step-000000000005\)"):
        faccel.checkpoint(dist, _state(1), f"{outer}/step-000000000005")
    assert _objects(s3) == []
    # A nested root as an older faccel let one write it: a run's committed checkpoint under the
    # outer root's step-5 prefix, beside a dead writer's object of that step and a stranger's.
    faccel.checkpoint(dist, _state(1), f"{s3.url}/other")
    fs.copy(f"{bucket}/other", f"{bucket}/exp/step-000000000005", recursive=True)
    fs.pipe_file(f"{bucket}/exp/step-000000000005/model.safetensors", b"a dead writer's")
    fs.pipe_file(f"{bucket}/exp/step-000000000005/notes.txt", b"not faccel's")
    faccel.checkpoint(dist, _state(6), outer)  # its cleanup meets the prefix without a manifest
    left = [name.removeprefix(f"{bucket}/exp/step-000000000005/") for name in _objects(s3)]
    assert "model.safetensors" not in left and "notes.txt" in left
    nested = f"{outer}/step-000000000005"  # (the copy put the run's folders right there)
    assert faccel.latest_checkpoint(nested) == f"{nested}/step-000000000001"
    assert faccel.restore(dist, _state(0), nested).step == 1


def test_a_4xx_answer_is_not_retried_and_not_called_throttling(s3: S3) -> None:
    import botocore.exceptions
    from s3fs.errors import translate_boto_error

    from faccel._storage._roots import spot_of

    store = spot_of(f"{s3.url}/run").store
    calls = []

    def bad_request() -> None:  # what s3fs raises for S3's 400 (a bad versionId, a bad argument)
        calls.append(1)
        answer = {
            "Error": {"Code": "InvalidArgument", "Message": "Invalid version id specified"},
            "ResponseMetadata": {"HTTPStatusCode": 400},
        }
        raise translate_boto_error(botocore.exceptions.ClientError(answer, "GetObject"))

    with pytest.raises(CheckpointError, match=r"HTTP 400.*not retried") as caught:
        store._call("reading", "bucket/key", bad_request)
    assert calls == [1] and "throttling" not in str(caught.value)


def test_a_live_writers_lease_is_never_taken_over(s3: S3) -> None:
    """The two interleavings that let a second writer in: a lease released (and taken by a third
    writer) between the contender's failed creation and its read; and two contenders that saw
    one dead lease, of which the later one deleted the lease the first had just taken."""
    from faccel._storage._objects import ObjectStore
    from faccel._storage._roots import spot_of

    spot = spot_of(f"{s3.url}/run")
    fs, protocol = spot.store.fs, spot.store.protocol
    key = f"{spot.key}/.lock"

    class Between(ObjectStore):
        """A contender around whose first read of the lease other writers act: ``before`` it, and
        ``after`` it (before the contender acts on what it read)."""

        def __init__(self, before: Any, after: Any) -> None:
            super().__init__(fs, protocol)
            self.around = [before, after]

        def _lease_raw(self, key: str) -> bytes:
            before, after = self.around
            self.around = [None, None]
            if before is not None:
                before()
            seen = super()._lease_raw(key)
            if after is not None:
                after()
            return seen

    third = ObjectStore(fs, protocol)
    with contextlib.ExitStack() as stack:
        stack.enter_context(ObjectStore(fs, protocol).lock(spot.key))
        taken = []

        def released() -> None:
            fs.rm_file(key)  # the first writer's lease released: the contender reads nothing

        def third_takes() -> None:
            taken.append(stack.enter_context(third.lock(spot.key)))

        with pytest.raises(CheckpointError, match="another process is writing"):
            Between(released, third_takes)._acquire(key, "second", spot.key)
        assert third.check_lock(taken[0]) is None  # the third writer's lease stands
    # A dead writer's lease (a pid of this host that is gone), seen by two contenders at once.
    dead = {"host": socket.gethostname(), "pid": 999_999_999, "token": "dead", "renewed": 0}
    fs.pipe_file(key, json.dumps(dead).encode())
    winner = ObjectStore(fs, protocol)
    with pytest.raises(CheckpointError, match="another process is writing"):
        Between(None, lambda: winner._acquire(key, "winner", spot.key))._acquire(key, "late", spot.key)
    assert winner._holder(key)["token"] == "winner"


def test_a_writer_killed_while_breaking_a_dead_lease_does_not_lock_the_root_forever(s3: S3) -> None:
    """A writer that won the break of a dead writer's lease and died before deleting it (a CI kill
    loop hit this window) left a break object every later writer lost to: the root refused every
    checkpoint from then on. The next writer now breaks the dead breaker's claim too."""
    from faccel._storage._objects import ObjectStore
    from faccel._storage._roots import spot_of

    root = f"{s3.url}/run"
    spot = spot_of(root)
    fs, protocol = spot.store.fs, spot.store.protocol
    key = f"{spot.key}/.lock"
    dead = {"host": socket.gethostname(), "pid": 999_999_999, "token": "dead", "renewed": 0}
    fs.pipe_file(key, json.dumps(dead).encode())

    class DiesAfterItsClaim(ObjectStore):
        """A breaker that dies (as a SIGKILL would leave it) once its break object is written."""

        def delete(self, key: str) -> None:
            raise SystemExit("killed")

    with pytest.raises(SystemExit):
        DiesAfterItsClaim(fs, protocol)._acquire(key, "breaker", spot.key)
    # the breaker's claim names this host and a pid that is gone, like its lease would
    claims = [name for name in fs.ls(spot.key) if ".lock-broken-" in name]
    assert claims
    for claim in claims:
        fs.pipe_file(claim, json.dumps({**dead, "token": "breaker"}).encode())
    dist = faccel.detect({})
    faccel.checkpoint(dist, _state(3), root)
    assert faccel.latest_checkpoint(root) == f"{root}/step-000000000003"
    assert not fs.exists(key)  # released after the write, as always
    fs.invalidate_cache()
    assert not [name for name in fs.ls(spot.key) if ".lock-broken-" in name]  # claims tidied


def test_a_check_failing_after_the_manifest_was_written_says_the_checkpoint_is_committed(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    from faccel._storage import _objects

    dist, root = faccel.detect({}), f"{s3.url}/run"
    real = _objects.ObjectStore._upload

    def lease_lost_after_commit(self: Any, key: str, views: Any, *, create: bool = False) -> None:
        real(self, key, views, create=create)
        if key.endswith("/manifest.json"):  # the commit: then the lease goes (the root cleared?)
            self.fs.rm_file(key.rsplit("/", 2)[0] + "/.lock")

    monkeypatch.setattr(_objects.ObjectStore, "_upload", lease_lost_after_commit)
    with pytest.raises(CheckpointError, match="so it is committed") as caught:
        faccel.checkpoint(dist, _state(2), root)
    assert "nothing was committed" not in str(caught.value)
    monkeypatch.undo()
    assert faccel.latest_checkpoint(root) == f"{root}/step-000000000002"


def test_a_survivor_of_a_peer_lost_after_the_commit_is_told_it_is_committed(s3: S3) -> None:
    from tests.distributed import harness
    from tests.distributed import object_store_workers as ow

    root = f"{s3.url}/run"
    rank0, _ = harness.run(ow.peer_lost_after_the_commit, world_size=2, lost=(1,), env=s3.env, root=root)
    assert rank0["latest"] == f"{root}/step-000000000002"
    assert "the checkpoint of step 2 is committed" in rank0["error"], rank0["error"]
