"""Checkpoints of a pipelined model on real gloo processes, restored at other layouts.

A run at pipeline=2 (2 gloo ranks, tests/distributed/pipeline_workers.py's ``Net``, Adam) takes 3
steps, checkpoints (the sharded format, keyed by the model's own names: each stage's rank writes
its own names), and takes 2 more. A fresh process group restores it at pipeline=2, at pipeline=1
over 2 data-parallel ranks (FSDP2), and in one process: the weights and Adam's moments come back
bitwise (the same floats); the 2 later losses are bitwise at the same layout, and at another layout
within rel 1e-5 / abs 1e-6 (float32: the micro-batches sum the same products in another order,
as tests/distributed/test_pipeline.py says).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import harness, pipeline_workers

TOLERANCE = {"rel": 1e-5, "abs": 1e-6}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    root = str(tmp_path_factory.mktemp("pipeckpt") / "ckpt")
    ranks = harness.run(pipeline_workers.ckpt_save, world_size=2, timeout=240, layout="pipeline=2", root=root)
    values: dict[str, Any] = {}
    for r in ranks:
        values |= r["values"]
    assert set(ranks[0]["values"]).isdisjoint(ranks[1]["values"])  # each stage its own names
    return root, {"values": values, "after": ranks[0]["after"], "before": ranks[0]["before"]}


def _check(ranks: list[dict[str, Any]], saved: dict[str, Any], *, same_layout: bool) -> None:
    names: set[str] = set()
    for r in ranks:
        assert r["step"] == 3
        for name, value in r["values"].items():
            assert value == saved["values"][name], name  # bitwise
        names |= set(r["values"])
        if same_layout:
            assert r["after"] == saved["after"]
        else:
            assert r["after"] == pytest.approx(saved["after"], **TOLERANCE)
    assert names == set(saved["values"])  # every weight and moment of the model came back


def test_pipeline_checkpoint_restores_at_pipeline_2(saved: tuple[str, dict[str, Any]]) -> None:
    root, values = saved
    ranks = harness.run(
        pipeline_workers.ckpt_resume, world_size=2, timeout=240, layout="pipeline=2", root=root
    )
    _check(ranks, values, same_layout=True)


def test_pipeline_checkpoint_restores_at_pipeline_1_data_parallel(saved: tuple[str, dict[str, Any]]) -> None:
    root, values = saved
    ranks = harness.run(pipeline_workers.ckpt_resume, world_size=2, timeout=240, layout="shard=2", root=root)
    _check(ranks, values, same_layout=False)


def test_pipeline_checkpoint_restores_in_one_process(saved: tuple[str, dict[str, Any]]) -> None:
    root, values = saved
    with torch.random.fork_rng():
        one = pipeline_workers.ckpt_resume(None, root)
    _check([one], values, same_layout=False)


def test_one_process_checkpoint_restores_at_pipeline_2(tmp_path: Path) -> None:
    """And back: a sharded checkpoint written without stages, restored into pipeline stages."""
    root = str(tmp_path / "ckpt")
    ranks = harness.run(pipeline_workers.ckpt_save, world_size=2, timeout=240, layout="shard=2", root=root)
    values: dict[str, Any] = {}
    for r in ranks:
        values |= r["values"]
    back = harness.run(
        pipeline_workers.ckpt_resume, world_size=2, timeout=240, layout="pipeline=2", root=root
    )
    _check(back, {"values": values, "after": ranks[0]["after"]}, same_layout=False)


def test_a_checkpoint_with_a_name_no_stage_holds_is_refused_on_every_rank(tmp_path: Path) -> None:
    """Each rank checks its own names, and every rank that the checkpoint is the whole model: a tensor
    that no stage holds (here a buffer of a larger model, saved in one process) is named."""
    import faccel

    root = str(tmp_path / "ckpt")
    with torch.random.fork_rng():
        dist = faccel.detect({})
        net = pipeline_workers.Net()
        net.register_buffer("extra", torch.zeros(2))
        optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
        faccel.checkpoint(dist, faccel.TrainState(model=net, optimizer=optimizer, step=1), root, sharded=True)
    ranks = harness.run(pipeline_workers.ckpt_other_model, world_size=2, timeout=240, root=root)
    for r in ranks:
        assert "holds tensor 'extra', which no pipeline stage of the model holds" in r


def test_consolidate_writes_the_whole_model_from_the_stages_checkpoint(
    saved: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """consolidate (no process group) of the pipeline=2 checkpoint: every stage's weights, as saved."""
    _check_consolidated(saved, tmp_path)


def _check_consolidated(saved: tuple[str, dict[str, Any]], tmp_path: Path) -> None:
    """consolidate the checkpoint (as ``python -m faccel consolidate``), load it into one model:
    every weight as the run saved it."""
    import faccel
    from faccel._hf._consolidate import consolidate

    root, values = saved
    out = consolidate(root, tmp_path / "hf")
    with torch.random.fork_rng():
        net = pipeline_workers.Net()
    faccel.load_model(faccel.detect({}), net, out)
    for name, param in net.named_parameters():
        assert param.detach().flatten().tolist() == values["values"][f"{name}:weight"], name


def test_save_model_of_stages_loads_into_the_whole_model(tmp_path: Path) -> None:
    """save_model at pipeline=2 (each rank writes its own stage's tensors, rank 0 commits the index):
    load_model into the plain model in one process gives every weight, the same floats."""
    import faccel

    out = str(tmp_path / "hf")
    ranks = harness.run(pipeline_workers.ckpt_save_model, world_size=2, timeout=240, out=out)
    with torch.random.fork_rng():
        net = pipeline_workers.Net()
    faccel.load_model(faccel.detect({}), net, out)
    values = ranks[0] | ranks[1]
    assert {f"{name}:weight" for name, _ in net.named_parameters()} == set(values)
    for name, param in net.named_parameters():
        assert param.detach().flatten().tolist() == values[f"{name}:weight"], name


def test_load_model_into_stages_reads_each_stage_and_steps_like_one_process(tmp_path: Path) -> None:
    """save_model of the whole model in one process; load_model into pipeline=2 stages (each rank
    takes its own stage's names only); the weights are the saved floats and one step equals one
    process's step within the float32 tolerance (micro-batches)."""
    folder = str(tmp_path / "hf")
    with torch.random.fork_rng():
        one = pipeline_workers.one_process_step(folder)
    ranks = harness.run(
        pipeline_workers.load_into_stages, world_size=2, timeout=240, layout="pipeline=2", folder=folder
    )
    assert set(ranks[0]["loaded"]).isdisjoint(ranks[1]["loaded"])  # each rank its own stage
    assert set(ranks[0]["loaded"]) | set(ranks[1]["loaded"]) == set(one["loaded"])
    for r in ranks:
        for name, value in r["loaded"].items():
            assert value == one["loaded"][name], name  # bitwise: the saved floats
        assert r["loss"] == pytest.approx(one["loss"], **TOLERANCE)
        for name, value in r["after"].items():
            assert value == pytest.approx(one["after"][name], **TOLERANCE), name


def test_save_model_of_llama_stages_loads_with_from_pretrained(tmp_path: Path) -> None:
    """A tiny Llama trained 2 steps at pipeline=2 (stages built from its own modules) and exported with
    save_model: transformers' from_pretrained loads it (config.json written from the whole model) and
    its logits equal those of the same training's one-process export within the float32 tolerance."""
    import transformers

    with torch.random.fork_rng():
        pipeline_workers.llama_export(None, str(tmp_path / "one"))
    harness.run(
        pipeline_workers.llama_export,
        world_size=2,
        timeout=240,
        layout="pipeline=2",
        out=str(tmp_path / "pp"),
    )
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        one = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one").eval()(tokens).logits
        staged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pp").eval()(tokens).logits
        fresh = pipeline_workers.tiny_llama().eval()(tokens).logits
    assert not torch.allclose(one, fresh)  # the export holds the trained weights, not a fresh model's
    assert torch.allclose(staged, one, rtol=1e-5, atol=1e-6), (staged - one).abs().max()


def _check_export(folder: Path, ranks: list[dict[str, Any]]) -> None:
    """save_model of stages over several ranks each: the whole model, every weight the final floats."""
    import faccel

    with torch.random.fork_rng():
        net = pipeline_workers.Net()
    faccel.load_model(faccel.detect({}), net, folder)
    final: dict[str, Any] = {}
    for r in ranks:
        final |= r["final"]
    assert {f"{name}:weight" for name, _ in net.named_parameters()} == set(final)
    for name, param in net.named_parameters():
        assert param.detach().flatten().tolist() == final[f"{name}:weight"], name


@pytest.fixture(scope="module")
def saved_by_rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    """At pipeline=2,shard=2 (4 gloo ranks; each stage FSDP2 over its 2 ranks): the weights loaded with
    load_model from a one-process export (each rank reads its own rows), 3 steps, a checkpoint, 2 more,
    save_model (its weights the final floats: each stage's tensors shared among its 2 ranks)."""
    tmp = tmp_path_factory.mktemp("pipeshard")
    folder, root, export = str(tmp / "hf"), str(tmp / "ckpt"), tmp / "export"
    with torch.random.fork_rng():
        one = pipeline_workers.one_process_step(folder)
    ranks = harness.run(
        pipeline_workers.ckpt_save,
        world_size=4,
        timeout=300,
        layout="pipeline=2,shard=2",
        root=root,
        load=folder,
        export=str(export),
    )
    _check_export(export, ranks)
    values: dict[str, Any] = {}
    for r in ranks:
        for name, value in r["loaded"].items():  # load_model by rows: the exported floats
            assert value == one["loaded"][name], name
        values |= r["values"]
    assert {n for r in ranks for n in r["loaded"]} == set(one["loaded"])
    assert all(r["after"] == ranks[0]["after"] for r in ranks)
    return root, {"values": values, "after": ranks[0]["after"]}


def test_pipeline_by_shard_checkpoint_writes_each_rank_its_own_rows(
    saved_by_rows: tuple[str, dict[str, Any]],
) -> None:
    """The index: each stage's tensors are cut in chunks of ceil(rows / 2) rows over its 2 ranks
    (stage 0 on ranks 0-1, stage 1 on ranks 2-3), each rank writing its own FSDP2 rows."""
    import json

    root, _ = saved_by_rows
    state = json.loads((Path(root) / "step-000000000003" / "state.json").read_text())
    model = state["tensors"]["model"]
    for name, entry in model.items():
        stage = 0 if name.startswith(("embed.", "layers.0.", "layers.1.")) else 1
        assert entry["first"] == 2 * stage, name
        assert entry["block"] == -(-entry["shape"][0] // 2), name


def test_pipeline_by_shard_checkpoint_restores_at_shard_2(saved_by_rows: tuple[str, dict[str, Any]]) -> None:
    root, values = saved_by_rows
    ranks = harness.run(pipeline_workers.ckpt_resume, world_size=2, timeout=240, layout="shard=2", root=root)
    _check(ranks, values, same_layout=False)


def test_pipeline_by_shard_checkpoint_restores_in_one_process(
    saved_by_rows: tuple[str, dict[str, Any]],
) -> None:
    root, values = saved_by_rows
    with torch.random.fork_rng():
        one = pipeline_workers.ckpt_resume(None, root)
    _check([one], values, same_layout=False)


def test_background_checkpoint_of_stages_restores_bitwise(tmp_path: Path) -> None:
    """checkpoint(..., blocking=False) at pipeline=2: written from host copies while the 2 next steps
    train; restored at pipeline=2 every weight and moment is the saved floats, and the 2 steps again
    give the same losses, bit for bit."""
    root = str(tmp_path / "ckpt")
    ranks = harness.run(
        pipeline_workers.ckpt_save, world_size=2, timeout=240, layout="pipeline=2", root=root, blocking=False
    )
    saved = {"values": ranks[0]["values"] | ranks[1]["values"], "after": ranks[0]["after"]}
    back = harness.run(
        pipeline_workers.ckpt_resume, world_size=2, timeout=240, layout="pipeline=2", root=root
    )
    _check(back, saved, same_layout=True)


def test_whole_tensor_checkpoint_restores_into_stages_over_shards(tmp_path: Path) -> None:
    """A one-process checkpoint in the whole-tensor format (version 3) restored at pipeline=2,shard=2:
    each rank keeps its own rows of the whole tensors it reads; bitwise, and the run continues alike."""
    root = str(tmp_path / "ckpt")
    with torch.random.fork_rng():
        one = pipeline_workers.ckpt_save(None, root)
    back = harness.run(
        pipeline_workers.ckpt_resume, world_size=4, timeout=300, layout="pipeline=2,shard=2", root=root
    )
    _check(back, one, same_layout=False)


def test_consolidate_of_a_pipeline_by_shard_checkpoint(
    saved_by_rows: tuple[str, dict[str, Any]], tmp_path: Path
) -> None:
    """consolidate (no process group) reads each stage's tensors from its ranks' chunks of rows."""
    _check_consolidated(saved_by_rows, tmp_path)
