"""The storage seam (issue 31, item 2): checkpoints call only the ``Store`` protocol.

``_checkpoint/`` makes no file call of its own (``os``/``shutil``/``open``), so a new store is one
module; ``restore`` lists a root once and reads the chosen manifest once; the same laws hold on
the in-process ``memory://`` store as on the disk.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

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
