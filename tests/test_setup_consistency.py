"""The set-up description compared across ranks at prepare, and its difference, in one process (pure).

The real two-process refusals are in tests/distributed/test_setup_consistency.py.
"""

from __future__ import annotations

import json
from typing import Any

import attrs
import torch
from hypothesis import given
from torch import nn

import faccel
from faccel._loop._consistency import check_setup, describe, difference_problem, encode, mismatch_problem
from faccel._loop._options import PrepareOptions
from tests.strategies import setup_description_pairs


def _first_difference(a: list[list[Any]], b: list[list[Any]]) -> int | None:
    for index in range(max(len(a), len(b))):
        if index >= len(a) or index >= len(b) or encode([a[index]]) != encode([b[index]]):
            return index
    return None


@given(setup_description_pairs())
def test_the_difference_is_none_exactly_when_the_descriptions_are_equal_and_names_the_first_item(
    pair: tuple[list[list[Any]], list[list[Any]]],
) -> None:
    reference, mine = pair
    problem = difference_problem(mine, reference, rank=1)
    assert (problem is None) == (encode(mine) == encode(reference))  # the digests' equality, exactly
    first = _first_difference(reference, mine)
    assert (first is None) == (problem is None)
    if problem is not None and first is not None:
        assert problem.startswith("rank 1: ")
        named = [e[1] for e in (mine[first : first + 1] or reference[first : first + 1])]
        assert named[0] in problem, (problem, first)
        # what travels between ranks is the JSON text: the same message from the decoded descriptions
        decoded = difference_problem(json.loads(encode(mine)), json.loads(encode(reference)), rank=1)
        assert decoded == problem


@given(setup_description_pairs())
def test_the_mismatch_named_is_the_lowest_rank_that_differs(
    pair: tuple[list[list[Any]], list[list[Any]]],
) -> None:
    reference, other = pair
    problem = mismatch_problem([reference, reference, other, other])
    assert (problem is None) == (encode(other) == encode(reference))
    if problem is not None:
        assert problem.startswith("rank 2: ")


def _model(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))


def test_a_wider_model_differs_at_its_first_weight_and_a_meta_build_keeps_its_shapes() -> None:
    dist = faccel.detect({})
    options = PrepareOptions()
    narrow, wide = describe(dist, [_model(16)], options), describe(dist, [_model(24)], options)
    assert difference_problem(wide, narrow, rank=1) == (
        "rank 1: parameter 0.weight has shape [24, 8], rank 0 has [16, 8] "
        "(the Sequential (argument 0) of this prepare call)"
    )
    with torch.device("meta"):
        meta_wide = describe(dist, [_model(24)], options)
    problem = difference_problem(meta_wide, narrow, rank=1)
    assert problem is not None and "built on meta is true, rank 0 has false" in problem
    with torch.device("meta"):
        meta_narrow = describe(dist, [_model(16)], options)
    problem = difference_problem(meta_wide, meta_narrow, rank=1)
    assert problem is not None and "parameter 0.weight has shape [24, 8], rank 0 has [16, 8]" in problem


def test_optimizer_loader_and_dist_items_are_described() -> None:
    model = _model()
    dist = faccel.detect({})
    options = PrepareOptions()
    data = torch.utils.data.TensorDataset(torch.randn(40, 8))
    objs = [
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        torch.utils.data.DataLoader(data, batch_size=4),
        "tag",
    ]
    items = {entry[1]: entry[2] for entry in describe(dist, objs, options)}
    assert items["objects"] == ["optimizer", "loader", "other value"]
    assert items["group 0"]["lr"] == 1e-3 and items["group 0"]["parameters"] == 4
    assert items["group 0"]["betas"] == [0.9, 0.999]
    assert items["group 0 parameter 0"] == {"shape": [16, 8], "dtype": "torch.float32"}
    assert (items["length"], items["batch_size"]) == (10, 4)
    assert items["dist.precision"] == "no" and items["dist.world_size"] == 1
    bf16 = describe(attrs.evolve(dist, precision="bf16"), objs, options)
    assert difference_problem(bf16, describe(dist, objs, options), rank=3) == (
        'rank 3: dist.precision is "bf16", rank 0 has "no" (the DistState of this prepare call)'
    )
    # a tag's value is not compared (a rank-dependent tag is fine), its kind is
    assert encode(describe(dist, ["a"], options)) == encode(describe(dist, ["b"], options))
    assert encode(describe(dist, ["a"], options)) != encode(describe(dist, [model], options))


class _Untouchable(nn.Module):
    def named_parameters(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise AssertionError("described in one process")


def test_one_process_describes_nothing_and_sends_nothing() -> None:
    """World size 1 and a simulated state: check_setup returns before describing (no cost)."""
    check_setup(faccel.detect({}), [_Untouchable()], PrepareOptions())
    check_setup(faccel.DistState.simulated(rank=1, world_size=4), [_Untouchable()], PrepareOptions())
    with_group = faccel.DistState(world_size=2, launcher="torchrun")  # peers, but none running here
    try:
        check_setup(with_group, [_model()], PrepareOptions())
    except faccel.errors.DistributedError as error:
        assert "needs a running process group" in str(error)
    else:
        raise AssertionError("a distributed state without a group was not refused")


def test_loader_order_scheduler_hyper_parameters_and_selections_are_described() -> None:
    """In one process: what the two-rank test compares, item by item."""
    dist = faccel.detect({})
    data = torch.utils.data.TensorDataset(torch.randn(40, 8))
    shuffled = describe(
        dist, [torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)], PrepareOptions()
    )
    plain = describe(dist, [torch.utils.data.DataLoader(data, batch_size=4)], PrepareOptions())
    problem = difference_problem(plain, shuffled, rank=1)
    assert (
        problem is not None and 'sampler has class "SequentialSampler", rank 0 has "RandomSampler"' in problem
    )
    items = {entry[1]: entry[2] for entry in shuffled}
    assert items["sampler"]["shuffle"] is True and items["batch_sampler"]["batch_size"] == 4

    optimizer = torch.optim.SGD(_model().parameters(), lr=0.1)
    step = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    hyper = {entry[1]: entry[2] for entry in describe(dist, [step], PrepareOptions())}["hyper-parameters"]
    assert hyper == {"step_size": 2, "gamma": 0.5}  # the counters (_step_count, _last_lr ...) left out

    def raises(module: nn.Module) -> bool:
        raise RuntimeError("a policy with a bug")

    options = PrepareOptions(shard_policy=raises, activation_checkpointing=lambda m: isinstance(m, nn.ReLU))
    items = {entry[1]: entry[2] for entry in describe(dist, [_model()], options)}
    assert (
        items["shard_policy selects"] == "raised RuntimeError"
    )  # described, not raised before the collective
    assert items["activation_checkpointing selects"] == ["1"]
