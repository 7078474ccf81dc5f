"""Ranks given different set-ups are refused at prepare, on both real gloo ranks, with the same named error.

Before: a model wider on rank 1 reached DDP's constructor, which raised torch's RuntimeError on one
rank and a gloo error on the other; FSDP2 and tensor parallelism sharded mismatched tensors.
The harness's timeout bounds how long the refusal may take (it must not hang).
"""

from __future__ import annotations

import re

import pytest

from tests.distributed import harness, setup_workers

# What each case's message must say: the rank, the first item that differs, both values.
EXPECTED = {
    "wider model": r"rank 1: parameter 0\.weight has shape \[24, 8\], rank 0 has \[16, 8\]",
    "wider model on meta": r"rank 1: parameter 0\.weight has shape \[24, 8\], rank 0 has \[16, 8\]",
    "learning rate": r"rank 1: group 0 has lr 0\.2, rank 0 has 0\.1 \(the SGD \(argument 0\)",
    "optimizer groups": r"rank 1: parameter groups is 2, rank 0 has 1",
    "loader length": r"rank 1: length is 12, rank 0 has 10 \(the DataLoader \(argument 0\)",
    "objects": r'rank 1: objects is \["model"\], rank 0 has \["model", "optimizer"\]',
    "precision": r'rank 1: dist\.precision is "bf16", rank 0 has "no"',
}


@pytest.mark.parametrize(("strategy", "layout"), [("ddp", None), ("fsdp", None), ("ddp", "tensor=2")])
def test_a_set_up_that_differs_on_one_rank_is_refused_on_every_rank(
    strategy: str, layout: str | None
) -> None:
    ranks = harness.run(setup_workers.mismatches, world_size=2, timeout=120, strategy=strategy, layout=layout)
    for rank, seen in enumerate(ranks):
        for case, pattern in EXPECTED.items():
            kind, message, is_faccel = seen[case]
            assert kind == "SetupMismatchError" and is_faccel, (rank, case, seen[case])
            assert message.startswith(f"prepare() on rank {rank}: "), message
            assert re.search(pattern, message), (case, message)
        assert seen["trained"]  # the group survived every refusal, and the same set-up is not refused


# set-ups that differ in what silently broke training (13 of 40 samples read twice,
# DDP parameters diverging, SIGABRT on one rank) before the check compared them.
ORDERS = {
    "shuffle": r'rank 1: sampler has class "SequentialSampler", rank 0 has "RandomSampler"',
    "replacement": r"rank 1: sampler has replacement true, rank 0 has false",
    "sampler seed": r"rank 1: sampler has seed 2, rank 0 has 1",
    "sampler class": r'rank 1: sampler has class "_SeededSampler", rank 0 has "RandomSampler"',
    "StepLR gamma": r"rank 1: hyper-parameters has gamma 0\.9, rank 0 has 0\.5 \(the StepLR \(argument 0\)",
    "cosine T_max": r"rank 1: hyper-parameters has T_max 20, rank 0 has 10 \(the CosineAnnealingLR",
    "shard_policy": r'rank 1: shard_policy selects is \[\], rank 0 has \["0", "2"\]',
}


def test_another_data_order_schedule_or_shard_policy_on_one_rank_is_refused_on_every_rank() -> None:
    ranks = harness.run(setup_workers.orders, world_size=2, timeout=120)
    for rank, seen in enumerate(ranks):
        for case, pattern in ORDERS.items():
            kind, message, is_faccel = seen[case]
            assert kind == "SetupMismatchError" and is_faccel, (rank, case, seen[case])
            assert message.startswith(f"prepare() on rank {rank}: "), message
            assert re.search(pattern, message), (case, message)
        assert seen["trained"]
