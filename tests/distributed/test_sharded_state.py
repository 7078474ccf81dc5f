"""Whole state dicts of FSDP2 models: gathered on 2 ranks, loaded into 2 ranks and into 1 process."""

from __future__ import annotations

import torch

from tests.distributed import harness, workers


def test_fsdp_state_gathers_whole_and_reshards_into_two_ranks_and_one_process() -> None:
    results = harness.run(workers.sharded_state_round_trip, world_size=2)
    for r in results:
        assert r["loaded"] == r["trained"]  # scattered back into a fresh 2-rank FSDP2 model
        assert r["exp_avg_equal"] and r["lr"] == 0.01
        assert r["betas_is_tuple"] and r["betas"] == [0.8, 0.95]  # a tuple, as saved
    # The same whole dicts load into a plain model and torch optimizer in one process (2 -> 1).
    saved_model = {k: torch.tensor(v) for k, v in results[0]["model_state"].items()}
    saved_opt = workers._tensors(results[0]["optimizer_state"])
    torch.manual_seed(3)
    plain = workers.Blocks()
    optimizer = torch.optim.AdamW(plain.parameters(), lr=0.5)
    plain.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_opt)
    assert [p.detach().flatten().tolist() for p in plain.parameters()] == results[0]["trained"]
    assert optimizer.param_groups[0]["lr"] == 0.01
    assert len(optimizer.state) == len(list(plain.parameters()))
