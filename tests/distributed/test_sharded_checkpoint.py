"""The sharded checkpoint format (version 2) with real processes: each rank writes its own shards,
and a restore at another world size reads only what it needs, bitwise."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
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


@pytest.mark.parametrize("layout", ["tensor=2", "replicate=2,tensor=2"])
def test_a_tensor_parallel_target_reads_only_its_rows_of_a_column_parallel_weight(
    tmp_path: Path, layout: str
) -> None:
    saved = harness.run(sw.save, world_size=2, root=str(tmp_path))  # inp.weight's rows 8: in shard 1
    expected = {k: v for k, v in saved[0]["state"].items() if k != "groups"}
    world = 2 if layout == "tensor=2" else 4
    restored = harness.run(sw.load_tensor_parallel, world_size=world, root=str(tmp_path), layout=layout)
    for result in restored:  # every tensor whole, bit for bit: split by rows, by columns, or not
        assert "error" not in result, result["error"]
        assert {k: v for k, v in result["state"].items() if k != "groups"} == expected
        assert result["placements"]["inp.weight"].endswith(("Shard(dim=0),)", "Shard(dim=0))"))
        assert "Shard(dim=1)" in result["placements"]["out.weight"]
    # The second half of inp.weight's rows is damaged: the ranks that hold those rows find it;
    # the others, whose rows lie in shard 0, never read them (a whole-tensor read would).
    broken = harness.run(
        sw.load_tensor_parallel, world_size=world, root=str(tmp_path), layout=layout, victim=1
    )
    for result in broken:
        if result["tensor"] == 1:
            assert "shard-00001.safetensors" in result["error"] and "checksum" in result["error"]
        else:
            assert "broken on another rank" in result["error"] and "shard-" not in result["error"]


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


def _rehash_in_manifest(folder: Path, name: str) -> None:
    data = (folder / name).read_bytes()
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _one_process_reads(folder: Path) -> list[str]:
    """What restore and consolidate say of ``folder`` in this process: their CheckpointErrors."""
    import faccel
    from faccel._hf._consolidate import consolidate

    torch.manual_seed(11)
    plain = sw.Blocks()
    state = faccel.TrainState.create(model=plain, optimizer=torch.optim.AdamW(plain.parameters()))
    errors = []
    with pytest.raises(faccel.errors.CheckpointError) as caught:
        faccel.restore(faccel.detect({}), state, folder)
    errors.append(str(caught.value))
    with pytest.raises(faccel.errors.CheckpointError) as caught:
        consolidate(folder, folder.parent / "hf")  # python -m faccel consolidate
    errors.append(str(caught.value))
    assert not (folder.parent / "hf").exists()  # nothing of the refused read left, not even its folder
    return errors


def test_consistent_edits_of_the_chunk_rule_or_a_shard_from_another_save_are_refused(tmp_path: Path) -> None:
    # the shard headers did not say which rows (or which save) they hold, so a
    # `first` edited in state.json (rehashed in the manifest) gave rows back permuted, and rank 1's
    # shard copied from another step (its rank page and the manifest updated) gave a mix of saves.
    written = harness.run(sw.save, world_size=2, root=str(tmp_path / "a"), steps=3)[0]["state"]
    harness.run(sw.save, world_size=2, root=str(tmp_path / "b"), steps=5)
    import faccel

    saved = faccel.latest_checkpoint(tmp_path / "a")
    other = faccel.latest_checkpoint(tmp_path / "b")
    assert saved is not None and other is not None
    permuted = tmp_path / "permuted" / saved.name
    shutil.copytree(saved, permuted)
    content = json.loads((permuted / "state.json").read_text())
    entry = content["tensors"]["model"]["inp.weight"]
    assert entry["block"] < entry["shape"][0]  # split over both ranks: moving `first` swaps them
    entry["first"] = (entry["first"] + 1) % 2
    (permuted / "state.json").write_text(json.dumps(content))
    _rehash_in_manifest(permuted, "state.json")
    for error in _one_process_reads(permuted):
        assert "edited chunk rule" in error and "inp.weight" in error, error

    mixed = tmp_path / "mixed" / saved.name
    shutil.copytree(saved, mixed)
    shutil.copyfile(other / "shard-00001.safetensors", mixed / "shard-00001.safetensors")
    raw = (mixed / "shard-00001.safetensors").read_bytes()
    head = raw[: 8 + struct.unpack("<Q", raw[:8])[0]]
    page = json.loads((mixed / "ranks-00000.json").read_text())
    page["ranks"][1]["shard"] = {"size": len(raw), "sha256": hashlib.sha256(head).hexdigest()}
    (mixed / "ranks-00000.json").write_text(json.dumps(page))
    _rehash_in_manifest(mixed, "ranks-00000.json")
    for error in _one_process_reads(mixed):
        assert "written by the save of step 5" in error and "checkpoint is step 3" in error, error

    # A shard written before these fields (no rows, no step in its header) is read as before.
    legacy = tmp_path / "legacy" / saved.name
    shutil.copytree(saved, legacy)
    page = json.loads((legacy / "ranks-00000.json").read_text())
    for rank in (0, 1):
        path = legacy / f"shard-{rank:05d}.safetensors"
        raw = path.read_bytes()
        length = struct.unpack("<Q", raw[:8])[0]
        header = json.loads(raw[8 : 8 + length])
        fields = json.loads(header["__metadata__"]["faccel"])
        header["__metadata__"]["faccel"] = json.dumps({k: fields[k] for k in ("hash_rows", "sha256")})
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        head = struct.pack("<Q", len(text)) + text
        path.write_bytes(head + raw[8 + length :])
        page["ranks"][rank]["shard"] = {
            "size": len(head) + len(raw) - 8 - length,
            "sha256": hashlib.sha256(head).hexdigest(),
        }
    (legacy / "ranks-00000.json").write_text(json.dumps(page))
    _rehash_in_manifest(legacy, "ranks-00000.json")
    torch.manual_seed(11)
    plain = sw.Blocks()
    state = faccel.TrainState.create(model=plain, optimizer=torch.optim.AdamW(plain.parameters()))
    assert faccel.restore(faccel.detect({}), state, legacy).step == 3
    assert {f"model/{k}": sw._digest(v) for k, v in plain.state_dict().items()} == {
        k: v for k, v in written.items() if k.startswith("model/")
    }
