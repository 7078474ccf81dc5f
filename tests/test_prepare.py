from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset

_KINDS = ["model", "optimizer", "scheduler", "loader", "int", "str", "none", "dict", "tensor"]


def _make(kind: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    return {
        "model": lambda: torch.nn.Linear(2, 2),
        "optimizer": lambda: optimizer,
        "scheduler": lambda: torch.optim.lr_scheduler.StepLR(optimizer, 1),
        "loader": lambda: DataLoader(TensorDataset(torch.zeros(6, 2)), batch_size=2),
        "int": lambda: 3,
        "str": lambda: "text",
        "none": lambda: None,
        "dict": lambda: {"lr": 0.1},
        "tensor": lambda: torch.ones(2),
    }[kind]()


@given(st.lists(st.sampled_from(_KINDS), min_size=0, max_size=8))
def test_prepare_returns_objects_in_the_given_order(kinds: list[str]) -> None:
    import faccel

    dist = faccel.detect({})
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    objs = [_make(kind, model, optimizer) for kind in kinds]
    out = faccel.prepare(dist, *objs)
    out = (out,) if len(objs) == 1 else out
    assert isinstance(out, tuple) and len(out) == len(objs)
    for kind, before, after in zip(kinds, objs, out, strict=True):
        if kind == "loader":
            assert isinstance(after, faccel.PreparedLoader) and after.dataset is before.dataset
        else:
            assert after is before  # modules (one process, fp32), optimizers, pass-through


def test_prepare_of_nothing_is_an_empty_tuple() -> None:
    import faccel

    assert faccel.prepare(faccel.detect({})) == ()


def test_model_is_wrapped_for_precision_not_patched() -> None:
    import faccel

    net = torch.nn.Linear(3, 2)
    forward_before = net.forward
    dist = faccel.DistState.simulated(precision="bf16")
    model = faccel.prepare(dist, net)
    assert model is not net and faccel.unwrap_model(model) is net
    assert net.forward == forward_before and "forward" not in net.__dict__
    out = model(torch.randn(4, 3))
    assert out.dtype == torch.float32  # computed in bf16, handed back in fp32
    assert faccel.prepare(dist, model) is model  # idempotent
    with pytest.raises(faccel.errors.PrepareError, match="another DistState"):
        faccel.prepare(faccel.detect({}), model)


def test_optimizer_state_follows_its_parameters() -> None:
    import faccel

    net = torch.nn.Linear(2, 1)
    params = list(net.parameters())
    optimizer = torch.optim.Adam(net.parameters(), lr=0.1)
    net(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    # The meta device stands in for an accelerator: CPU tensors can move there.
    dist = faccel.DistState.simulated(device="meta")
    net, optimizer = faccel.prepare(dist, net, optimizer)
    # meta makes new Parameter objects; the optimizer of the same call follows them
    assert [p for g in optimizer.param_groups for p in g["params"]] == list(net.parameters())
    assert set(optimizer.state) == set(net.parameters())
    assert all(p.device.type == "meta" for p in net.parameters()) and len(params) == 2
    for state in optimizer.state.values():
        assert state["exp_avg"].device.type == "meta"
        assert state["step"].device.type == "cpu"  # Adam keeps its step count on the CPU


def test_prepared_loader_is_idempotent_or_refused() -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=1, world_size=4)
    loader = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(9)), batch_size=2))
    assert faccel.prepare(dist, loader) is loader
    with pytest.raises(faccel.errors.PrepareError, match="rank 1 of 4"):
        faccel.prepare(faccel.DistState.simulated(rank=0, world_size=4), loader)


def test_scheduler_advances_once_per_step() -> None:
    import faccel

    net = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 0.5**s)
    dist = faccel.DistState.simulated(rank=0, world_size=8)
    net, optimizer, scheduler = faccel.prepare(dist, net, optimizer, scheduler)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert scheduler.last_epoch == 3 and optimizer.param_groups[0]["lr"] == 0.125


def test_bad_dist_is_a_type_error() -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentError, match="dist"):
        faccel.prepare(None, torch.nn.Linear(1, 1))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda m: TensorDataset(torch.ones(4, 2)), "wrap it in a torch.utils.data.DataLoader"),
        (lambda m: m.parameters(), "model.parameters"),
        (lambda m: [m, torch.optim.SGD(m.parameters(), lr=0.1)], "one by one"),
        (lambda m: {"model": m}, "one by one"),
    ],
)
def test_prepare_refuses_what_it_would_pass_back_unprepared(make: Any, match: str) -> None:
    import faccel

    with pytest.raises(faccel.errors.PrepareError, match=match):
        faccel.prepare(faccel.detect({}), make(torch.nn.Linear(2, 1)))


def test_prepare_passes_plain_values_through() -> None:
    import faccel

    config = {"lr": 0.1, "names": ["a", "b"]}
    tag, got, pair = faccel.prepare(faccel.detect({}), "tag", config, (1, 2))
    assert (tag, got, pair) == ("tag", config, (1, 2)) and got is config
