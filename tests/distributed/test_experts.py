"""Expert parallelism on real gloo processes: a tiny Mixtral at ``expert=2`` trains as one process does
(losses, every weight), with uneven routing, and a peer dying in the all-to-all is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.budget import expert_moves
from tests.distributed import experts_workers, harness


def _check_like_one_process(ranks: list[dict], rows: int = 2) -> None:
    for r in ranks:
        # the dispatch only moves rows: the same losses and weights as one process, to float32 rounding
        # (the one process averages the loss over the global batch at once, two ranks each over half)
        assert r["losses"] == pytest.approx(r["reference"], rel=1e-5, abs=1e-6)
        assert max(r["worst"].values()) < 1e-5, r["worst"]
        # the model's own names, each rank holding its rows of the four experts
        assert all(shape[0] == rows for shape in r["shapes"].values()), r["shapes"]
    assert all(r["keys"] == ranks[0]["keys"] for r in ranks)
    # the load, summed over the ranks, is what one process routed for the global batch
    assert ranks[0]["world_routed"][:1] == ranks[0]["one_routed"][:1] == ranks[1]["world_routed"][:1]


def test_expert_parallel_trains_as_one_process_even_with_every_token_to_one_rank() -> None:
    both = harness.run(experts_workers.train_both, world_size=2, timeout=120, layout="expert=2")
    _check_like_one_process([r["even"] for r in both])
    assert both[0]["even"]["routed"][0] != both[1]["even"]["routed"][0]  # each rank's own tokens
    # uneven routing: every router weight zero
    ranks = [r["skew"] for r in both]
    _check_like_one_process(ranks)
    first = ranks[0]["world_routed"][0]
    # every token to one rank's two experts (topk's choice among ties), none to the other rank's
    assert all(sorted(counts) == [0, 0, 32, 32] for counts in first.values()), first
    assert all(counts[:2] == [0, 0] or counts[2:] == [0, 0] for counts in first.values()), first


@expert_moves
def test_an_expert_parallel_checkpoint_restores_at_any_layout_and_exports_for_transformers(
    tmp_path: Path,
) -> None:
    root, model_dir = tmp_path / "ckpt", tmp_path / "model"
    both = harness.run(
        experts_workers.train_both,
        world_size=2,
        timeout=120,
        layout="expert=2",
        root=str(root),
        model_dir=str(model_dir),
    )
    _check_like_one_process([r["even"] for r in both])
    # the checkpoint at expert=2 restores in one process, bitwise, optimizer state included
    import faccel

    saved = both[0]["even"]
    model = experts_workers.tiny_mixtral(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    one = faccel.detect({})
    model, optimizer = faccel.prepare(one, model, optimizer)
    state = faccel.restore(one, faccel.TrainState.create(model=model, optimizer=optimizer), root)
    assert experts_workers.digests(state.model, optimizer) == saved["digests"]
    # ... and into shard=2 (FSDP2, no expert split) and expert=4 (one expert a rank), bitwise
    for layout, world in (("shard=2", 2), ("expert=4", 4)):
        ranks = harness.run(
            experts_workers.restore_into, world_size=world, timeout=180, layout=layout, root=str(root)
        )
        assert all(r == saved["digests"] for r in ranks), layout
    # load_model reads the export into expert=4, each rank its own expert
    ranks = harness.run(
        experts_workers.load_into, world_size=4, timeout=180, layout="expert=4", model_dir=str(model_dir)
    )
    weights = {k: v for k, v in saved["digests"].items() if ":" not in k}
    for r in ranks:
        assert {k: v for k, v in r.items() if k != "shapes"} == weights
        assert all(shape[0] == 1 for shape in json.loads(r["shapes"]).values())
    # save_model wrote the Hugging Face layout under the model's own names: from_pretrained reads it,
    # and its logits are the expert-parallel model's
    from transformers import MixtralForCausalLM

    loaded = MixtralForCausalLM.from_pretrained(model_dir)
    loaded.config._experts_implementation = "eager"
    probe = experts_workers.batches_of(2)[0][:2]
    # (to float32 rounding: on two ranks each expert multiplied both ranks' probe rows at once)
    torch.testing.assert_close(loaded(probe).logits, torch.tensor(saved["logits"]), rtol=1e-5, atol=1e-6)


@expert_moves
def test_experts_beside_shards_train_as_one_process_and_restore_in_one(tmp_path: Path) -> None:
    # torchtitan's dp_shard x ep: the rest of the model sharded over the 4 ranks, each expert group's
    # block of experts sharded again over the 2 ranks that hold it (one expert's rows a rank)
    root, model_dir = tmp_path / "ckpt", tmp_path / "model"
    both = harness.run(
        experts_workers.train_both,
        world_size=4,
        timeout=300,
        layout="shard=2,expert=2",
        root=str(root),
        model_dir=str(model_dir),
    )
    _check_like_one_process([r["even"] for r in both], rows=1)
    _check_like_one_process([r["skew"] for r in both], rows=1)
    # its checkpoint restores in one process, bitwise, optimizer state included
    import faccel

    model = experts_workers.tiny_mixtral(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    one = faccel.detect({})
    model, optimizer = faccel.prepare(one, model, optimizer)
    state = faccel.restore(one, faccel.TrainState.create(model=model, optimizer=optimizer), root)
    assert experts_workers.digests(state.model, optimizer) == both[0]["even"]["digests"]


@expert_moves
@pytest.mark.parametrize(
    ("layout", "world", "strategy"),
    [
        ("pipeline=2,expert=2", 4, None),
        ("tensor=2,expert=2", 4, None),
        ("replicate=2,expert=2", 4, None),
        ("expert=2", 2, "fsdp"),  # FSDP2 asked for: the experts their own one-rank units
    ],
)
def test_experts_beside_stages_tensor_ranks_or_replicas_train_as_one_process_and_restore_in_one(
    layout: str, world: int, strategy: str | None, tmp_path: Path
) -> None:
    # 4 ranks, 2 experts of the 4 on each. pipeline=2: each stage's block splits its experts over
    # the stage's 2 ranks (an all-to-all inside the stage, between the schedule's sends), the rest
    # of the stage sharded by FSDP2 over them. tensor=2: the input and read-out layers split over
    # the tensor ranks, whose pair holds the same tokens and experts. replicate=2: HSDP, each
    # block of experts averaged over the replicas that hold it.
    root = tmp_path / "ckpt"
    one = experts_workers.experts_beside(layout=None)
    ranks = harness.run(
        experts_workers.experts_beside,
        world_size=world,
        timeout=300,
        layout=layout,
        root=str(root),
        strategy=strategy,
    )
    names: set[str] = set()
    for r in ranks:
        # the same arithmetic in another order (micro-batches, two ranks' halves): float32 rounding
        assert r["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-6)
        assert r["losses"] == ranks[0]["losses"]
        for name, value in r["weights"].items():
            assert value == pytest.approx(one["weights"][name], rel=1e-5, abs=1e-6), name
        assert r["rows"] and all(rows == 2 for rows in r["rows"].values()), r["rows"]  # 2 of 4 experts
        names |= set(r["weights"])
    assert names == set(one["weights"])  # the stages together hold the whole model
    # the checkpoint restores in one process, bitwise
    restored = experts_workers.moe_net_restored(str(root))
    assert restored == {name: value for r in ranks for name, value in r["weights"].items()}


def test_a_peer_dying_in_the_all_to_all_is_named_on_the_survivor() -> None:
    survivor, _ = harness.run(
        experts_workers.peer_dies_in_the_all_to_all, world_size=2, timeout=120, lost=(1,)
    )
    assert survivor["error"] is not None
    assert "all-to-all of experts module experts" in survivor["error"]
    assert "expert group [0, 1]" in survivor["error"]
