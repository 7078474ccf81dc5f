"""The sharded format in one process: an exact round trip of every feature, and damaged files that
raise one CheckpointError naming the file, with nothing modified."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest

from tests.distributed import checkpoint_workers as cw
from tests.manifests import entry_of
from tests.test_checkpoint_errors import _state

pytestmark = pytest.mark.usefixtures("keep_global_generators")  # restore sets the global generators


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    import faccel

    dist = faccel.detect({})
    state = _state(0)
    model, optimizer, loader = faccel.prepare(dist, state.model, state.optimizer, cw.data(cw.example_spec()))
    state = cw.train(dist, attrs.evolve(state, model=model, optimizer=optimizer), loader, until=3)
    folder = faccel.checkpoint(dist, state, tmp_path_factory.mktemp("saved"), sharded=True)
    return folder, cw.digest(state)


@pytest.fixture
def folder(saved: tuple[Path, str], tmp_path: Path) -> Path:
    copy = tmp_path / saved[0].name
    shutil.copytree(saved[0], copy)
    return copy


def test_every_feature_round_trips_exactly(saved: tuple[Path, str]) -> None:
    import faccel

    assert sorted(p.name for p in saved[0].iterdir()) == [
        "extras.safetensors",
        "manifest.json",
        "ranks-00000.json",
        "rng-00000.json",
        "shard-00000.safetensors",
        "state.json",
    ]
    target = _state(1)  # tied weights, batch norm buffers, AMSGrad, scheduler, scaler, extras
    restored = faccel.restore(faccel.detect({}), target, saved[0])
    assert cw.digest(target) == saved[1] and restored.step == 3
    assert restored.extras["counts"] == {"a": (1, 2)}


def _flip(name: str, where: float) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        data = bytearray((folder / name).read_bytes())
        data[int(len(data) * where)] ^= 0xFF
        (folder / name).write_bytes(bytes(data))

    return edit


def _truncate(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).write_bytes((folder / name).read_bytes()[:-8])


CASES = {
    "flipped data byte": (_flip("shard-00000.safetensors", 0.9), "shard-00000.safetensors", "checksum"),
    "flipped header byte": (_flip("shard-00000.safetensors", 0.02), "shard-00000.safetensors", "checksum"),
    "truncated shard": (_truncate("shard-00000.safetensors"), "shard-00000.safetensors", "bytes"),
    "deleted shard": (
        lambda f: (f / "shard-00000.safetensors").unlink(),
        "shard-00000.safetensors",
        "missing",
    ),
    "flipped rank page": (_flip("ranks-00000.json", 0.5), "ranks-00000.json", "checksum"),
    "deleted rank page": (lambda f: (f / "ranks-00000.json").unlink(), "ranks-00000.json", "missing"),
    "flipped generators": (_flip("rng-00000.json", 0.5), "rng-00000.json", "checksum"),
    "flipped state": (_flip("state.json", 0.5), "state.json", "checksum"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_damaged_sharded_checkpoints_raise_naming_the_file_and_modify_nothing(
    folder: Path, case: str
) -> None:
    import faccel

    damage, file, words = CASES[case]
    damage(folder)
    target = _state(1)
    cw.seed_generators(0, 42)
    before = cw.observe(target)
    with pytest.raises(faccel.errors.CheckpointError) as error:
        faccel.restore(faccel.detect({}), target, folder)
    assert file in str(error.value) and words in str(error.value), str(error.value)
    cw.assert_same(cw.observe(target), before)


def test_load_model_on_a_sharded_checkpoint_points_to_consolidate(saved: tuple[Path, str]) -> None:
    import faccel

    with pytest.raises(faccel.errors.CheckpointError, match="python -m faccel consolidate"):
        faccel.load_model(faccel.detect({}), _state(1).model, saved[0])


def _claim_huge(folder: Path) -> None:
    """state.json (rehashed in the manifest: consistent, not corrupted) claims an optimizer tensor of
    2^40 rows: what a reader would allocate if it trusted the index before the files."""
    import json

    content = json.loads((folder / "state.json").read_text())
    entry = content["tensors"]["optimizer"]["state.0.exp_avg"]
    entry["shape"] = [2**40, *entry["shape"][1:]]
    entry["block"] = 2**40
    data = json.dumps(content).encode()
    (folder / "state.json").write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"]["state.json"] = entry_of(manifest, data)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_an_index_claiming_a_huge_tensor_is_refused_before_anything_is_allocated(folder: Path) -> None:
    import faccel

    _claim_huge(folder)
    target = _state(1)
    before = cw.observe(target)
    # A state that fits neither its parameter nor a scalar is never read, and the checks name it (a
    # 2^40-row buffer, 2^40 x 5 x 4 bytes, would have failed with a RuntimeError of the allocator).
    with pytest.raises(
        faccel.errors.CheckpointError, match=r"'exp_avg' of parameter 0 is torch.float32 \[1099511627776, 4\]"
    ):
        faccel.restore(faccel.detect({}), target, folder)
    cw.assert_same(cw.observe(target), before)


def test_reads_that_need_more_memory_than_the_process_can_take_are_refused_before_allocating() -> None:
    # a tensor the target takes whole with no shape to compare with (the state of
    # an optimizer that has not stepped, of a class faccel does not know) is bounded by memory.
    import resource

    import torch

    import faccel
    from faccel._checkpoint._sharded._chunks import Placed
    from faccel._checkpoint._sharded._flow import allocatable_bytes, check_allocatable

    room = allocatable_bytes()
    assert room is not None and room > 0
    rows = room // 4 + 1
    huge = Placed(dtype=torch.float32, shape=(rows,), block=rows, first=0)
    small = Placed(dtype=torch.float32, shape=(8,), block=8, first=0)
    with pytest.raises(faccel.errors.CheckpointError, match=r"optimizer/state\.0\.buf.*more than the"):
        check_allocatable([("optimizer", "state.0.buf", huge, True, 0, rows)], "ckpt")
    check_allocatable([("optimizer", "state.0.buf", small, True, 0, 8)], "ckpt")  # fits: no error
    # A tensor that is not read (None: it fits nothing of the target) costs nothing.
    check_allocatable([("optimizer", "state.0.buf", huge, None, 0, rows)], "ckpt")
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    assert soft == resource.RLIM_INFINITY or room <= soft
