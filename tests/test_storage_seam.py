"""The storage seam: checkpoints and exports call only the ``Store`` protocol.

The guard is behaviour: every public function that takes a root (found by its signature, so a new
one must join the table) runs against fsspec's in-process ``memory://`` store and a real S3
server (moto's), writes nothing on the local disk, and what it writes is read back through the
store; the local-only ones refuse a URL by name. Besides: ``_checkpoint/`` and ``_hf/`` make no
file call of their own and import nothing of the disk's store; ``restore`` lists a root once and
reads the chosen manifest once; the same laws hold on ``memory://`` as on the disk.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from tests.object_store import moto_server_fixture, s3_fixture  # noqa: F401 - the fixtures

ROOT = Path(__file__).resolve().parent.parent / "faccel"
# Calls that touch files or folders: what must go through the store.
_FILE_CALLS = {
    "open",
    "scandir",
    "listdir",
    "rename",
    "replace",
    "remove",
    "unlink",
    "rmtree",
    "mkdir",
    "makedirs",
    "stat",
    "fstat",
    "pread",
    "preadv",
    "pwrite",
    "fsync",
    "fdatasync",
    "close",
    "read",
    "write",
    "ftruncate",
    "exists",
    "isdir",
    "isfile",
    "islink",
    "rmdir",
}


def _file_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id == "open":
            found.append(f"{path.name}:{node.lineno} open()")
        elif (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id in {"os", "shutil"}
            and func.attr in _FILE_CALLS
        ) or (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Attribute)
            and isinstance(func.value.value, ast.Name)
            and func.value.value.id == "os"
            and func.value.attr == "path"
        ):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(func)}()")
    return found


@pytest.mark.parametrize("package", ["_checkpoint", "_hf"])
def test_checkpoints_and_exports_make_no_file_call_outside_the_store(package: str) -> None:
    calls = [call for path in sorted((ROOT / package).rglob("*.py")) for call in _file_calls(path)]
    assert calls == [], f"file calls in {package}/ outside the storage modules: {calls}"
    disk = [
        f"{path.name}: {line.strip()}"
        for path in sorted((ROOT / package).rglob("*.py"))
        for line in path.read_text().splitlines()
        if "store.local" in line or "_storage._local" in line or "_storage import _local" in line
    ]
    assert disk == [], f"{package}/ asks for the disk by name: {disk}"


# Public functions with a parameter of a path that is not a root (a config file).
_NOT_ROOTS = {"detect"}
# Those that write local files only, by design: a URL is refused by name, nothing written.
_LOCAL_ONLY = {"profile": lambda dist, url: faccel_profile(dist, url)}


def faccel_profile(dist: Any, url: str) -> None:
    import faccel

    with faccel.profile(dist, url):
        pass


def _every_root_call(dist: Any, root: str) -> dict[str, Any]:
    """Each public function that takes a root, run on ``root``; each result checked by a reader."""
    import faccel
    from faccel._hf._consolidate import consolidate
    from faccel._hf._save_model import convert_weights

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    state = attrs.evolve(state, step=1)
    fresh = torch.nn.Linear(4, 3)
    target = faccel.TrainState.create(model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1))
    done: dict[str, Any] = {}
    done["checkpoint"] = faccel.checkpoint(dist, state, f"{root}/run")
    done["latest_checkpoint"] = faccel.latest_checkpoint(f"{root}/run")
    done["restore"] = faccel.restore(dist, target, f"{root}/run", into=f"{root}/next").step
    assert torch.equal(fresh.weight, model.weight)
    done["save_model"] = faccel.save_model(dist, model, f"{root}/model")
    other = torch.nn.Linear(4, 3)
    done["load_model"] = faccel.load_model(dist, other, f"{root}/model")
    assert torch.equal(other.weight, model.weight)
    tracker = faccel.init_tracker(dist, f"{root}/logs")
    faccel.log(dist, tracker, 1, {"loss": 1.0})
    faccel.end_training(dist, tracker)
    done["init_tracker"] = faccel.latest_checkpoint(f"{root}/logs") is None  # a folder, not a run
    # Not in faccel's namespace, public through the command line: a checkpoint's and a model's exports.
    done["consolidate"] = consolidate(f"{root}/run", f"{root}/consolidated")
    done["convert_weights"] = convert_weights(f"{root}/consolidated", f"{root}/converted")
    back = torch.nn.Linear(4, 3)
    faccel.load_model(dist, back, f"{root}/converted")
    assert torch.equal(back.weight, model.weight)
    return done


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_every_public_function_that_takes_a_root_works_on_any_store_and_writes_nothing_local(
    where: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import inspect

    import fsspec

    import faccel

    if where == "s3":
        pytest.importorskip("s3fs")
        root = request.getfixturevalue("s3").url
        fs = request.getfixturevalue("s3").fs()
        prefix = root.removeprefix("s3://")
    else:
        root, fs = f"memory:///seam-{tmp_path.name}", fsspec.filesystem("memory")
        prefix = f"/seam-{tmp_path.name}"
    takes_root = {
        name
        for name in faccel.__all__
        if callable(function := getattr(faccel, name)) and not inspect.isclass(function)
        for parameter in inspect.signature(function).parameters.values()
        if "PathLike" in str(parameter.annotation)
    }
    monkeypatch.chdir(tmp_path)
    dist = faccel.detect({})
    done = _every_root_call(dist, root)
    assert takes_root - _NOT_ROOTS - set(_LOCAL_ONLY) <= set(done), "a new root-taking function to add here"
    assert done["checkpoint"] == done["latest_checkpoint"] == f"{root}/run/step-000000000001"
    assert done["restore"] == 1 and done["init_tracker"]
    for name in ("save_model", "consolidate", "convert_weights"):
        assert str(done[name]).startswith(root), (name, done[name])
    for name, call in _LOCAL_ONLY.items():
        with pytest.raises(faccel.errors.ArgumentValueError, match="is a URL"):
            call(dist, f"{root}/{name}")
    fs.invalidate_cache()
    written = {path.removeprefix(prefix).lstrip("/").split("/")[0] for path in fs.find(prefix)}
    assert written == {"run", "model", "logs", "consolidated", "converted"}
    assert list(tmp_path.iterdir()) == []  # nothing on the local disk
    if where == "memory":
        fs.rm(prefix, recursive=True)


def test_restore_lists_the_root_once_and_reads_the_chosen_manifest_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import faccel
    from faccel._storage._local import LocalStore

    model = torch.nn.Linear(3, 2)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    dist = faccel.detect({})
    for step in range(4):
        faccel.checkpoint(dist, attrs.evolve(state, step=step), tmp_path)
    listed: Counter[str] = Counter()
    read: Counter[str] = Counter()
    real_list, real_read = LocalStore.list, LocalStore.read

    def counting_list(self: Any, key: str) -> Any:
        listed[Path(key).name] += 1
        return real_list(self, key)

    def counting_read(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
        read[str(Path(key).relative_to(tmp_path))] += 1
        return real_read(self, key, *args, **kwargs)

    monkeypatch.setattr(LocalStore, "list", counting_list)
    monkeypatch.setattr(LocalStore, "read", counting_read)
    assert faccel.restore(dist, state, tmp_path).step == 3
    # The root once; the chosen checkpoint once (the extra-object check, on the main process only).
    assert listed == Counter({tmp_path.name: 1, "step-000000000003": 1})
    manifests = {name: n for name, n in read.items() if name.endswith("manifest.json")}
    assert manifests == {"manifest.json": 1, "step-000000000003/manifest.json": 1}  # the root's: absent


@pytest.mark.parametrize("sharded", [False, True])
def test_the_in_process_store_keeps_the_disk_laws(sharded: bool) -> None:
    """memory:// : round trip, only committed steps count, keep deletes after the commit."""
    import fsspec

    import faccel

    root = f"memory://seam-{sharded}"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.AdamW(model.parameters()))
    dist = faccel.detect({})
    for step in range(3):
        faccel.checkpoint(dist, attrs.evolve(state, step=step), root, keep=2, sharded=sharded)
    fs = fsspec.filesystem("memory")
    fs.pipe_file(f"/seam-{sharded}/step-000000000009/state.json", b"{}")  # a writer killed mid-way
    assert faccel.latest_checkpoint(root) == f"memory:///seam-{sharded}/step-000000000002"
    fresh = torch.nn.Linear(4, 3)
    target = faccel.TrainState.create(model=fresh, optimizer=torch.optim.AdamW(fresh.parameters()))
    assert faccel.restore(dist, target, root).step == 2 and torch.equal(fresh.weight, model.weight)
    with pytest.raises(faccel.errors.CheckpointError, match=r"later checkpoints|already"):
        faccel.checkpoint(dist, attrs.evolve(state, step=1), root)
    faccel.checkpoint(dist, attrs.evolve(state, step=10), root, keep=1, sharded=sharded)
    left = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"/seam-{sharded}", detail=False))
    assert left == ["step-000000000010"]  # the orphan of step 9 and the older ones are gone
    fs.rm(f"/seam-{sharded}", recursive=True)
