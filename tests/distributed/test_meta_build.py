"""A model built on meta, prepared on two real gloo processes: sharded first, then only local shards
allocated, and initialized bitwise as the eager build after the same seed, in every layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed import harness, meta_workers

# (layout, strategy): FSDP2 over both ranks, DDP (materialized whole), tensor parallelism, HSDP.
CASES = [(None, "fsdp"), (None, "ddp"), ("tensor=2", "ddp"), ("replicate=2", "fsdp")]


@pytest.mark.parametrize(("layout", "strategy"), CASES)
def test_a_meta_built_model_is_prepared_bitwise_equal_to_its_eager_build(
    layout: str | None, strategy: str
) -> None:
    ranks = harness.run(meta_workers.meta_matches_eager, world_size=2, layout=layout, strategy=strategy)
    for r in ranks:
        assert r["equal"] == r["names"]  # every parameter and buffer, the rotary table included
        assert r["tied"] and r["rng"] and r["finite"]
    sharded = {"fsdp": layout is None, "ddp": False}[strategy] or layout == "tensor=2"
    local = ranks[0]["local"]
    if sharded:  # each rank allocated its rows only
        assert local["blocks.0.up.weight"][0] < 16, local
    else:
        assert local["blocks.0.up.weight"] == [16, 8], local
    assert ranks[0]["loss"] == ranks[1]["loss"]
    assert ranks[0]["grads"] == ranks[1]["grads"]


@pytest.mark.parametrize(("layout", "strategy"), CASES)
def test_init_empty_then_load_model_reads_each_rank_s_rows_into_its_shards(
    layout: str | None, strategy: str, tmp_path: Path
) -> None:
    ranks = harness.run(
        meta_workers.empty_then_load, world_size=2, root=str(tmp_path), layout=layout, strategy=strategy
    )
    for r in ranks:
        assert r["equal"] == r["names"]  # the weights: bitwise
        # logits: bitwise, except where a row-wise split sums its partial products in another order
        assert r["gap"] <= (1e-5 if layout == "tensor=2" else 0.0)
    if layout is None and strategy == "fsdp":  # each rank read about half the rows of the sharded weights
        assert 0 < ranks[0]["read"] < ranks[0]["sharded_bytes"] * 0.7, ranks[0]
        assert 0 < ranks[1]["read"] < ranks[1]["sharded_bytes"] * 0.7, ranks[1]


def test_a_legacy_bin_is_read_whole_and_each_rank_keeps_its_rows(tmp_path: Path) -> None:
    ranks = harness.run(
        meta_workers.empty_then_load,
        world_size=2,
        root=str(tmp_path),
        layout=None,
        strategy="fsdp",
        legacy=True,
    )
    for r in ranks:
        assert r["equal"] == r["names"] and r["gap"] == 0.0


def test_fsdp_policies_and_activation_checkpointing_keep_the_gradients_bitwise(tmp_path: Path) -> None:
    """One 2-rank run: FSDP2 plain, with activation checkpointing, reshard_after_forward=False, both,
    offload='cpu' (a no-op move on a CPU run, but the policy runs), bf16 with and without AC; DDP with
    and without AC; tensor parallelism with and without AC. Dropout is on: the recomputed forward
    draws the same masks."""
    ranks = harness.run(meta_workers.policies_run, world_size=2, timeout=120, root=str(tmp_path))
    for r in ranks:
        for case in ("fsdp_ac", "fsdp_keep", "fsdp_ac_keep", "fsdp_offload"):
            assert r[case]["grads"] == r["fsdp"]["grads"], case  # bitwise
            assert r[case]["loss"] == r["fsdp"]["loss"], case
        assert r["bf16_ac"]["grads"] == r["bf16"]["grads"]
        assert r["ddp_ac"]["grads"] == r["ddp"]["grads"]
        assert r["tp_ac"]["grads"] == r["tp"]["grads"]  # the recomputed forward reruns TP's collectives
        for case, result in r.items():
            if not isinstance(result, dict):
                continue
            before, after = result["keys"]
            assert before == after, case  # the state_dict keys are the model's own
            checkpointed = ["blocks.0", "blocks.1"] if "_ac" in case else []
            assert result["checkpointed"] == checkpointed, case
            # the recomputed forward ran the block's layers a second time, in the backward
            assert len(result["compute"]) == (2 if "_ac" in case else 1), case
        for plain, with_ac in (("fsdp", "fsdp_ac"), ("bf16", "bf16_ac"), ("ddp", "ddp_ac"), ("tp", "tp_ac")):
            assert r[plain]["saved"] == r[with_ac]["saved"]  # save_model writes the same names
        # FSDP2's mixed precision from dist.precision: sharded parameters float32, computed in bf16
        assert r["bf16"]["sharded_dtypes"] == ["torch.float32"]
        assert set(r["bf16"]["compute"]) == {"torch.bfloat16"}
        assert set(r["fsdp"]["compute"]) == {"torch.float32"}
        assert r["fsdp_offload"]["sharded_devices"] == r["fsdp_offload"]["grad_devices"] == ["cpu"]
        assert "offload='cpu', an FSDP2 option" in r["ddp_offload_refused"]
    assert ranks[0]["ddp"]["grads"] == ranks[1]["ddp"]["grads"]  # DDP's gradients: whole, averaged
    assert ranks[0]["fsdp"]["grads"] != ranks[1]["fsdp"]["grads"]  # FSDP2's: each rank's own shard
