"""The sharded checkpoint format (version 2) with real processes: each rank writes its own shards,
and a restore at another world size reads only what it needs, bitwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import harness
from tests.distributed import sharded_workers as sw


def _plain_load(root: Path) -> dict:
    """Restore into a plain model in this process (one rank, no process group)."""
    import faccel

    torch.manual_seed(11)
    model = sw.Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    restored = faccel.restore(faccel.detect({}), state, root)
    return {"state": sw.global_state(model, optimizer), "step": restored.step}


def test_fsdp_writes_one_shard_per_rank_and_reshards_2_to_1_and_2_to_3(tmp_path: Path) -> None:
    saved = harness.run(sw.save, world_size=2, root=str(tmp_path))
    assert saved[0]["state"] == saved[1]["state"]
    files = saved[0]["files"]
    assert sorted(files) == [
        "extras.safetensors",
        "manifest.json",
        "ranks-00000.json",
        "rng-00000.json",
        "rng-00001.json",
        "shard-00000.safetensors",
        "shard-00001.safetensors",
        "state.json",
    ]
    # Each rank wrote its own half of the state (no whole model file, nothing gathered).
    halves = [files["shard-00000.safetensors"], files["shard-00001.safetensors"]]
    assert 0.4 < halves[0] / sum(halves) < 0.6
    # 2 -> 3 FSDP2 ranks (uneven rows: 16 -> 6, 6, 4; 1 -> 1, 0, 0): global state bitwise equal.
    loaded = harness.run(sw.load, world_size=3, root=str(tmp_path))
    for r in loaded:
        assert r["param_types"] == ["DTensor"] and r["step"] == 3
        assert r["state"] == saved[0]["state"]
    # 2 -> 1 plain process.
    plain = _plain_load(tmp_path)
    assert plain["state"] == saved[0]["state"] and plain["step"] == 3


def test_fsdp_reshards_1_to_2_3_to_2_and_the_same_world_size(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    # One process prepares no FSDP2 (nothing to shard over): sharded=True asks for the format.
    saved = harness.run(sw.save, world_size=1, root=str(one), sharded=True)
    assert "shard-00000.safetensors" in saved[0]["files"]
    loaded = harness.run(sw.load, world_size=2, root=str(one))
    assert all(r["state"] == saved[0]["state"] for r in loaded)
    saved = harness.run(sw.save, world_size=2, root=str(two))
    loaded = harness.run(sw.load, world_size=2, root=str(two))
    assert all(r["state"] == saved[0]["state"] for r in loaded)
    # 3 -> 2: rows 6, 6, 4 read as 8, 8: each reader takes part of a writer's chunk.
    three = tmp_path / "three"
    saved = harness.run(sw.save, world_size=3, root=str(three))
    loaded = harness.run(sw.load, world_size=2, root=str(three))
    assert all(r["state"] == saved[0]["state"] for r in loaded)


def test_ddp_splits_the_replicated_state_across_ranks_and_any_world_size_reads_it(tmp_path: Path) -> None:
    saved = harness.run(sw.save, world_size=2, root=str(tmp_path), strategy="ddp", sharded=True)
    files = saved[0]["files"]
    halves = [files["shard-00000.safetensors"], files["shard-00001.safetensors"]]
    assert 0.3 < halves[0] / sum(halves) < 0.7  # balanced by bytes: both ranks write
    expected = {k: v for k, v in saved[0]["state"].items() if k != "groups"}
    # 2 -> 1, 2 -> 3 readers of whole tensors (what a DDP rank needs), bitwise.
    for world in (1, 3):
        read = harness.run(sw.read_whole, world_size=world, root=str(tmp_path))
        assert all(r["version"] == 2 and r["world"] == 2 and r["digests"] == expected for r in read)
    # 2 -> 1 through restore, and 2 -> 2 FSDP2 (DDP's checkpoint into a sharded model).
    assert _plain_load(tmp_path)["state"] == saved[0]["state"]
    loaded = harness.run(sw.load, world_size=2, root=str(tmp_path))
    assert all(r["state"] == saved[0]["state"] for r in loaded)


def test_ddp_1_to_2_reads_a_one_process_sharded_checkpoint(tmp_path: Path) -> None:
    import attrs

    import faccel

    torch.manual_seed(0)
    model = sw.Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    faccel.checkpoint(faccel.detect({}), attrs.evolve(state, step=1, epoch=1), tmp_path, sharded=True)
    expected = {k: v for k, v in sw.global_state(model, optimizer).items() if k != "groups"}
    read = harness.run(sw.read_whole, world_size=2, root=str(tmp_path))
    assert all(r["digests"] == expected for r in read)


def test_each_rank_reads_only_its_own_rows(tmp_path: Path) -> None:
    harness.run(sw.save, world_size=2, root=str(tmp_path))
    results = harness.run(sw.corrupt_and_load, world_size=2, root=str(tmp_path), victim=1)
    # Rank 1's rows of inp.weight are corrupted: rank 1 finds it; rank 0 never reads them.
    assert "shard-00001.safetensors" in results[1]["error"] and "checksum" in results[1]["error"]
    assert "broken on another rank" in results[0]["error"] and "shard-" not in results[0]["error"]
    assert results[0]["state"] == results[1]["state"]  # nothing loaded anywhere


@pytest.mark.parametrize("sharded", [False])
def test_fsdp_can_still_write_whole_tensors(tmp_path: Path, sharded: bool) -> None:
    saved = harness.run(sw.save, world_size=2, root=str(tmp_path), sharded=sharded)
    assert "model.safetensors" in saved[0]["files"]
    loaded = harness.run(sw.load, world_size=2, root=str(tmp_path))
    assert all(r["state"] == saved[0]["state"] for r in loaded)


def test_consolidate_writes_the_hugging_face_layout_without_a_process_group(tmp_path: Path) -> None:
    import faccel
    from faccel.__main__ import main

    saved = harness.run(sw.save, world_size=2, root=str(tmp_path / "ckpt"))
    expected = {k: v for k, v in saved[0]["state"].items() if k.startswith("model/")}
    # The command line, in this process (no process group): one file, then shards and an index.
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    assert (
        main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf2"), "--max-shard-size", "1000B"]) == 0
    )
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["model.safetensors"]
    assert "model.safetensors.index.json" in {p.name for p in (tmp_path / "hf2").iterdir()}
    for folder in ("hf", "hf2"):
        model = sw.Blocks()
        assert faccel.load_model(faccel.detect({}), model, tmp_path / folder) == ((), ())
        state = {f"model/{k}": sw._digest(v) for k, v in model.state_dict().items()}
        assert state == expected
    # A second run into the same folder is refused, not mixed in.
    assert main(["consolidate", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 1


def test_a_background_checkpoint_commits_the_state_of_the_call_while_fsdp_trains_on(tmp_path: Path) -> None:
    results = harness.run(sw.background_save, world_size=2, root=str(tmp_path))
    for r in results:
        assert r["after"] != r["saved"]  # training went on during the write
        assert r["loaded"]["state"] == r["saved"] and r["loaded"]["step"] == 3


def test_a_background_failure_on_one_rank_is_raised_on_every_rank_by_the_next_call(tmp_path: Path) -> None:
    results = harness.run(sw.background_save, world_size=2, root=str(tmp_path), fail_on=1)
    errors = [r["loaded"]["error"] for r in results]
    assert all("background checkpoint of step 3" in e for e in errors)
    assert "No space left on device" in errors[1] and "failed on rank(s) [1]" in errors[0]
    assert not list(tmp_path.glob("step-*"))  # nothing committed
