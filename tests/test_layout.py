"""Layout: the N-D rank grid ``(pipeline, replicate, shard, context, tensor)`` as pure arithmetic, checked
against PyTorch's DeviceMesh convention for any world size and factorisation; validation in DistState and
the environment."""

from __future__ import annotations

import itertools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import layout_grids, layout_sizes

DIMENSIONS = ("pipeline", "replicate", "shard", "context", "tensor")


def test_the_dimensions_are_torchtitans_order() -> None:
    from faccel._dist._layout import DATA_DIMENSIONS
    from faccel._dist._layout import DIMENSIONS as named

    # pp, dp_replicate, dp_shard, cp, tp: pipeline outermost, tensor innermost
    assert named == DIMENSIONS and DATA_DIMENSIONS == ("replicate", "shard")


@settings(max_examples=40)
@given(layout_grids(max_world=32))
def test_coordinates_and_groups_are_those_of_init_device_mesh(sizes: dict[str, int]) -> None:
    import faccel

    layout = faccel.Layout(**sizes)
    assert layout.sizes == sizes and layout.shape == tuple(sizes[d] for d in DIMENSIONS)
    # init_device_mesh lays the ranks out as arange(world).view(shape): row-major, tensor innermost
    grid = torch.arange(layout.world_size).view(*layout.shape)
    assert layout.world_size == grid.numel()
    assert layout.data_size == sizes["replicate"] * sizes["shard"] == layout.size("data")
    for rank in range(layout.world_size):
        point = layout.coordinates(rank)
        assert grid[point].item() == rank and layout.rank_of(point) == rank
        named = dict(zip(DIMENSIONS, point, strict=True))
        assert layout.rank_of(named) == rank
        assert all(layout.coordinate(d, rank) == named[d] for d in DIMENSIONS)
        # each dimension's group: the ranks along that axis of the grid through this rank
        for axis, dimension in enumerate(DIMENSIONS):
            line = grid[tuple(slice(None) if i == axis else c for i, c in enumerate(point))]
            assert layout.members(dimension, rank) == tuple(line.tolist())
        # the data group: replicate and shard free, every other coordinate this rank's
        plane = grid[tuple(slice(None) if d in ("replicate", "shard") else named[d] for d in DIMENSIONS)]
        assert layout.members("data", rank) == tuple(plane.flatten().tolist())
        # the data-parallel rank: position in the data group, the same along every other dimension
        assert layout.data_rank(rank) == layout.members("data", rank).index(rank)
        for other in ("pipeline", "context", "tensor"):
            peers = layout.members(other, rank)
            assert {layout.data_rank(peer) for peer in peers} == {layout.data_rank(rank)}
    for dimension in (*DIMENSIONS, "data"):
        groups = layout.groups(dimension)
        assert sorted(rank for group in groups for rank in group) == list(range(layout.world_size))
        assert {len(group) for group in groups} == {layout.size(dimension)}


@settings(max_examples=50)
@given(layout_grids(max_world=24))
def test_coordinates_are_a_bijection(sizes: dict[str, int]) -> None:
    import faccel

    layout = faccel.Layout(**sizes)
    points = [layout.coordinates(rank) for rank in range(layout.world_size)]
    every = list(itertools.product(*(range(sizes[d]) for d in DIMENSIONS)))
    assert points == every  # row-major: each point once, in order
    assert [layout.rank_of(p) for p in every] == list(range(layout.world_size))


def test_the_pipeline_stages_are_contiguous_blocks() -> None:
    import faccel

    layout = faccel.Layout(pipeline=2, shard=2, tensor=2)
    assert layout.groups("pipeline") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert [layout.coordinate("pipeline", r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert layout.groups("data") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert layout.data_size == 2 and [layout.data_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert repr(layout) == "Layout(replicate=1, shard=2, tensor=2, pipeline=2)"


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda layout: layout.coordinate("pipe", 0), "dimension must be one of"),
        (lambda layout: layout.members("pipe", 0), "dimension must be one of"),
        (lambda layout: layout.rank_of({"pipe": 0}), "dimension must be one of"),
        (lambda layout: layout.rank_of((0, 0, 0)), "one per dimension"),
        (lambda layout: layout.rank_of({"pipeline": 2}), r"pipeline coordinate must be in \[0, 2\)"),
        (lambda layout: layout.coordinates(8), r"rank must be in \[0, 8\)"),
    ],
)
def test_a_wrong_name_or_coordinate_is_refused_by_name(call: object, match: str) -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentValueError, match=match):
        call(faccel.Layout(pipeline=2, shard=2, tensor=2))  # type: ignore[operator]


@given(layout_grids(max_world=64))
def test_n_d_layout_text_round_trips(sizes: dict[str, int]) -> None:
    import faccel
    from faccel._dist._layout import parse_layout

    layout = faccel.Layout(**sizes)
    assert parse_layout(str(layout)) == layout
    assert eval(repr(layout), {"Layout": faccel.Layout}) == layout


@given(layout_sizes())
def test_layout_text_round_trips(sizes: tuple[int, int, int]) -> None:
    from faccel._dist._layout import parse_layout

    layout = __import__("faccel").Layout(*sizes)
    assert parse_layout(str(layout)) == layout


@given(layout_sizes(), st.integers(min_value=1, max_value=4))
def test_dist_state_takes_a_layout_only_of_its_world_size(sizes: tuple[int, int, int], extra: int) -> None:
    import faccel

    layout = faccel.Layout(*sizes)
    for rank in (0, layout.world_size - 1):
        dist = faccel.DistState.simulated(rank=rank, world_size=layout.world_size, layout=layout)
        assert dist.parallel == layout and dist.data_world_size == layout.data_size
        assert dist.data_rank == layout.data_rank(rank)
    with pytest.raises(faccel.errors.LaunchError, match="choose sizes whose product is the world size"):
        faccel.DistState.simulated(world_size=layout.world_size + extra, layout=layout)


@pytest.mark.parametrize("bad", [0, -1, 2.0, "2", True])
def test_layout_sizes_are_ints_of_at_least_one(bad: object) -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentValueError, match=r"Layout\.shard must be an int >= 1"):
        faccel.Layout(shard=bad)  # type: ignore[arg-type]


def test_without_a_layout_the_strategy_decides_as_before() -> None:
    import faccel

    ddp = faccel.DistState.simulated(rank=2, world_size=4)
    fsdp = faccel.DistState.simulated(rank=2, world_size=4, strategy="fsdp")
    assert ddp.parallel == faccel.Layout(replicate=4) and fsdp.parallel == faccel.Layout(shard=4)
    assert (ddp.data_rank, ddp.data_world_size, fsdp.data_rank, fsdp.data_world_size) == (2, 4, 2, 4)


def test_a_layout_that_contradicts_the_strategy_is_refused() -> None:
    import faccel

    with pytest.raises(faccel.errors.LaunchError, match="strategy 'ddp' never does"):
        faccel.DistState(world_size=4, strategy="ddp", layout=faccel.Layout(shard=4))
    with pytest.raises(faccel.errors.LaunchError, match="use strategy='fsdp'"):
        faccel.DistState(world_size=4, strategy="ddp", layout=faccel.Layout(replicate=2, tensor=2))
    # tensor parallelism alone (one data-parallel rank) or replicas alone suit DDP's strategy too
    assert faccel.DistState(world_size=4, strategy="ddp", layout=faccel.Layout(tensor=4)).data_world_size == 1
    assert faccel.DistState(world_size=4, strategy="ddp", layout=faccel.Layout(replicate=4)).distributed


def _env(rank: int, world: int, **extra: str) -> dict[str, str]:
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "h", "MASTER_PORT": "1", **extra}


def test_the_layout_comes_from_the_argument_or_faccel_layout() -> None:
    import faccel

    from_env = faccel.state_from_env(_env(3, 4, FACCEL_LAYOUT="shard=2, tensor=2"))
    assert from_env.layout == faccel.Layout(shard=2, tensor=2)
    assert (from_env.strategy, from_env.data_rank, from_env.data_world_size) == ("fsdp", 1, 2)
    # the argument wins over the variable; a layout of replicas alone keeps DDP
    given = faccel.state_from_env(_env(3, 4, FACCEL_LAYOUT="tensor=4"), layout="replicate=4")
    assert (given.layout, given.strategy) == (faccel.Layout(replicate=4), "ddp")
    # an explicit strategy is kept, and checked against the layout
    with pytest.raises(faccel.errors.LaunchError, match="strategy 'ddp' never does"):
        faccel.state_from_env(_env(0, 4, FACCEL_STRATEGY="ddp"), layout=faccel.Layout(shard=4))
    assert faccel.state_from_env(_env(0, 4)).layout is None


@pytest.mark.parametrize("text", ["shard=2,shard=2", "pipe=2", "shard=0", "shard=two", ""])
def test_a_malformed_faccel_layout_names_the_variable(text: str) -> None:
    import faccel

    with pytest.raises(faccel.errors.LaunchError, match=re.escape(f"FACCEL_LAYOUT={text!r}")):
        faccel.state_from_env(_env(0, 4, FACCEL_LAYOUT=text))
    with pytest.raises(faccel.errors.LaunchError, match=re.escape(f"layout={text!r}")):
        faccel.state_from_env(_env(0, 4), layout=text)


def test_a_tensor_parallel_layout_needs_a_plan_that_names_real_submodules() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    import faccel
    from faccel._loop._strategies._mesh._tp_plan import apply_plan, plan_problem

    dist = faccel.DistState.simulated(rank=0, world_size=4, layout=faccel.Layout(tensor=4))
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    with pytest.raises(faccel.errors.PrepareError, match="got no tp_plan"):
        apply_plan(dist, net, None)
    with pytest.raises(faccel.errors.PrepareError, match=r"tp_plan key 'mlp\.up' names no submodule"):
        apply_plan(dist, net, {"mlp.up": ColwiseParallel()})
    assert "not a ParallelStyle" in plan_problem(net, {"0": "colwise"})
    assert plan_problem(net, {"*": ColwiseParallel()}) == ""  # a pattern: every child


def test_one_process_ignores_the_plan_and_trains_as_before() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    import faccel

    net = torch.nn.Linear(4, 2)
    model = faccel.prepare(faccel.detect({}), net, tp_plan={"nothing": ColwiseParallel()})
    assert model is net and type(net.weight) is torch.nn.Parameter
