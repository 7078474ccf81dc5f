"""Expert parallelism on real gloo processes: a tiny Mixtral at ``expert=2`` trains as one process does
(losses, every weight), with uneven routing, and a peer dying in the all-to-all is named."""

from __future__ import annotations

import pytest

from tests.distributed import experts_workers, harness


def _check_like_one_process(ranks: list[dict]) -> None:
    for r in ranks:
        # the dispatch only moves rows: the same losses and weights as one process, to float32 rounding
        # (the one process averages the loss over the global batch at once, two ranks each over half)
        assert r["losses"] == pytest.approx(r["reference"], rel=1e-5, abs=1e-6)
        assert max(r["worst"].values()) < 1e-5, r["worst"]
        # the model's own names, each rank holding its two of the four experts
        assert all(shape[0] == 2 for shape in r["shapes"].values()), r["shapes"]
    assert ranks[0]["keys"] == ranks[1]["keys"]
    # the load, summed over the ranks, is what one process routed for the global batch
    assert ranks[0]["world_routed"][:1] == ranks[0]["one_routed"][:1] == ranks[1]["world_routed"][:1]


def test_expert_parallel_trains_as_one_process_even_with_every_token_to_one_rank() -> None:
    both = harness.run(experts_workers.train_both, world_size=2, timeout=120, layout="expert=2")
    ranks = [r["even"] for r in both]
    _check_like_one_process(ranks)
    assert ranks[0]["routed"][0] != ranks[1]["routed"][0]  # each rank's own tokens
    # uneven routing: every router weight zero
    ranks = [r["skew"] for r in both]
    _check_like_one_process(ranks)
    first = ranks[0]["world_routed"][0]
    # every token to one rank's two experts (topk's choice among ties), none to the other rank's
    assert all(sorted(counts) == [0, 0, 32, 32] for counts in first.values()), first
    assert all(counts[:2] == [0, 0] or counts[2:] == [0, 0] for counts in first.values()), first


def test_a_peer_dying_in_the_all_to_all_is_named_on_the_survivor() -> None:
    survivor, _ = harness.run(
        experts_workers.peer_dies_in_the_all_to_all, world_size=2, timeout=120, lost=(1,)
    )
    assert survivor["error"] is not None
    assert "all-to-all of experts module experts" in survivor["error"]
    assert "expert group [0, 1]" in survivor["error"]
