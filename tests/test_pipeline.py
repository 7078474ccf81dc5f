"""Pipeline stages in one process: the schedule as a value, where stages sit, the one step, the refusals.

The multi-process runs (2 and 4 gloo ranks, every schedule) are in tests/distributed/test_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

KINDS = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv"]


@given(st.sampled_from(KINDS), st.integers(min_value=1, max_value=8))
def test_every_stage_sits_on_exactly_one_pipeline_rank(kind: str, pipeline: int) -> None:
    import faccel
    from faccel._loop._strategies._pipeline._stages import stage_indices

    schedule = faccel.Schedule(kind=kind)
    placed = [s for r in range(pipeline) for s in stage_indices(schedule, r, pipeline)]
    assert sorted(placed) == list(range(pipeline * schedule.per_rank))
    assert schedule.micro(pipeline=pipeline) == pipeline * schedule.per_rank


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "1F1B"}, "Schedule.kind must be one of"),
        ({"microbatches": 0}, "Schedule.microbatches must be an int >= 1"),
        ({"stages_per_rank": 2.0}, "Schedule.stages_per_rank must be an int >= 1"),
    ],
)
def test_a_wrong_schedule_is_refused_by_name(kwargs: dict[str, object], match: str) -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentValueError, match=match):
        faccel.Schedule(**kwargs)  # type: ignore[arg-type]


def test_forward_backward_is_the_two_lines_of_the_seed_loop() -> None:
    import faccel

    dist = faccel.DistState(accumulation_steps=2)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    b.load_state_dict(a.state_dict())
    x, y = torch.randn(4, 3), torch.randn(4, 1)
    for micro, (xs, ys) in faccel.micro_batches(dist, [(x[:2], y[:2]), (x[2:], y[2:])]):
        got = faccel.forward_backward(dist, a, torch.nn.functional.mse_loss, xs, ys, micro=micro)
        loss = torch.nn.functional.mse_loss(b(xs), ys)
        faccel.backward(dist, loss, micro=micro)
        assert got.item() == loss.item() and not got.requires_grad
    assert torch.equal(a.weight.grad, b.weight.grad) and torch.equal(a.bias.grad, b.bias.grad)


def _net() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))


@pytest.mark.parametrize(
    ("kwargs", "strategy", "match"),
    [
        ({}, "fsdp", "got no split="),
        ({"split": ("9",)}, "fsdp", r"split names \['9'\]"),
        ({"split": "1"}, "fsdp", "split must be a non-empty tuple"),
        ({"split": ("1",)}, "ddp", "use strategy='fsdp'"),
    ],
)
def test_prepare_refuses_a_pipeline_it_cannot_build(
    kwargs: dict[str, object], strategy: str, match: str
) -> None:
    import faccel

    dist = faccel.DistState.simulated(world_size=2, layout=faccel.Layout(pipeline=2), strategy=strategy)
    with pytest.raises(faccel.errors.PrepareError, match=match):
        faccel.prepare(dist, _net(), **kwargs)  # type: ignore[arg-type]


def test_a_pipelined_model_is_not_called_directly() -> None:
    import faccel
    from faccel._loop._options import PrepareOptions
    from faccel._loop._strategies._pipeline._stages import PipelinedModel

    dist = faccel.DistState.simulated(world_size=2, layout=faccel.Layout(pipeline=2))
    model = PipelinedModel(dist, _net(), ("1",), faccel.Schedule(), PrepareOptions())
    assert not model.built and list(model.parameters()) == []  # no stage before the first step
    with pytest.raises(faccel.errors.UsageError, match=r"faccel\.forward_backward"):
        model(torch.zeros(1, 2))


def test_without_pipeline_stages_split_and_schedule_are_unused() -> None:
    import faccel

    net = _net()
    model = faccel.prepare(faccel.detect({}), net, split=("1",), schedule=faccel.Schedule(kind="zbv"))
    assert model is net


def test_a_meta_built_model_allocates_only_this_ranks_stage() -> None:
    from tests.distributed import harness, pipeline_workers

    ranks = harness.run(pipeline_workers.meta_stages, world_size=2, timeout=120)
    assert ranks[0]["loss"] == ranks[1]["loss"] > 0
    held = [set(r["local"]) for r in ranks]
    assert held[0].isdisjoint(held[1]) and len(held[0] | held[1]) == 12  # each stage's own, together all
    assert {device for r in ranks for device in r["local"].values()} == {"cpu"}
