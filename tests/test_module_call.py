"""faccel._func._module_call: a bound call equals torch.func.functional_call, leaving the module as it was."""

from __future__ import annotations

import copy
import itertools
import warnings
from typing import Any

import pytest
import torch
from hypothesis import given
from torch import nn

from faccel._func._module_call import ModuleCaller, bind
from tests import strategies as fst


def _build(spec: dict) -> nn.Module:
    torch.manual_seed(spec["seed"])
    widths = spec["widths"]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i == 0 and spec["norm"]:
            layers.append(nn.BatchNorm1d(b))
        layers.append(nn.Tanh())
    # The first and last layers map width -> ... -> width; a square extra layer to tie with.
    layers.append(nn.Linear(widths[-1], widths[-1]))
    model = nn.Sequential(*layers)
    if spec["tie"] == "alias":
        model.add_module("alias", layers[-1])  # one Linear under two names
    elif spec["tie"] == "weight" and widths[0] == widths[-1]:
        first = next(m for m in model if isinstance(m, nn.Linear))
        if first.weight.shape == layers[-1].weight.shape:
            layers[-1].weight = first.weight  # two Linears, one weight
    return model


def _tensors(model: nn.Module, spec: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    params = {n: torch.randn(p.shape, generator=g).requires_grad_() for n, p in model.named_parameters()}
    for name in list(params)[: spec["drop"]]:
        del params[name]  # the module's own tensor is used for a name left out
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    return params, buffers


def _snapshot(model: nn.Module) -> dict[str, Any]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def _reference(model: nn.Module, params: dict, buffers: dict, x: torch.Tensor) -> torch.Tensor:
    # On a copy: functional_call itself leaves a module reachable under two names holding
    # the given tensor afterwards (torch 2.13), which a later comparison would inherit.
    model = copy.deepcopy(model)
    return torch.func.functional_call(model, (params, buffers) if buffers else params, x)


@given(spec=fst.module_specs(), with_buffers=fst.st.booleans())
def test_a_bound_call_equals_functional_call_with_its_gradients(spec: dict, with_buffers: bool) -> None:
    model = _build(spec).train()
    params, buffers = _tensors(model, spec)
    buffers = buffers if with_buffers else {}
    x = torch.randn(4, spec["widths"][0], generator=torch.Generator().manual_seed(spec["seed"]))
    before = _snapshot(model)
    caller = ModuleCaller(model)

    # Buffers are updated in place by BatchNorm in train mode: each side gets its own copy.
    got = caller(params, {k: v.clone() for k, v in buffers.items()}, x)
    want = _reference(model, params, {k: v.clone() for k, v in buffers.items()}, x)

    assert torch.equal(got, want)
    grads_got = torch.autograd.grad(got.sum(), list(params.values()), allow_unused=True)
    grads_want = torch.autograd.grad(want.sum(), list(params.values()), allow_unused=True)
    for a, b in zip(grads_got, grads_want, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    after = _snapshot(model)
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)


def test_bind_records_every_slot_of_a_tied_weight_under_its_first_name() -> None:
    model = _build({"widths": [3, 3], "norm": True, "tie": "weight", "drop": 0, "seed": 0})
    bound = bind(model)

    assert list(bound.params) == [name for name, _ in model.named_parameters()]
    assert len(bound.params["0.weight"]) == 2  # layers 0 and 3 share it
    assert list(bound.buffers) == ["1.running_mean", "1.running_var", "1.num_batches_tracked"]


def test_a_submodule_replaced_after_bind_is_used_not_ignored() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    caller = ModuleCaller(model)
    model[2] = nn.Linear(2, 1)  # new weights: the bound slots now point at a detached module
    params = {n: torch.ones_like(p) for n, p in model.named_parameters()}
    x = torch.ones(1, 2)

    assert torch.equal(caller(params, {}, x), _reference(model, params, {}, x))
    assert caller(params, {}, x).item() == 7.0  # relu(2*1+1)=3 per unit; 3+3+1


def test_a_parameter_deleted_after_bind_gives_torchs_own_answer() -> None:
    model = nn.Linear(2, 1)
    caller = ModuleCaller(model)
    del model.bias
    params = {"weight": torch.ones(1, 2), "bias": torch.ones(1)}

    # functional_call sets the missing name as a plain attribute, so the answer is still 3.
    assert caller(params, {}, torch.ones(1, 2)).item() == 3.0
    assert "bias" not in model._parameters


def test_a_failing_forward_puts_the_modules_own_tensors_back() -> None:
    class Boom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.lin(x)
            raise ValueError("boom")

    model = Boom()
    before = _snapshot(model)
    zeros = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="boom"):
        ModuleCaller(model)(zeros, {}, torch.ones(1, 2))
    assert all(_snapshot(model)[name] is before[name] for name in before)


def test_parametrized_lazy_and_scripted_modules() -> None:
    class Symmetric(nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w.triu() + w.triu(1).transpose(-1, -2)

    model = nn.Linear(3, 3)
    torch.nn.utils.parametrize.register_parametrization(model, "weight", Symmetric())
    params = {n: torch.randn(p.shape) for n, p in model.named_parameters()}
    x = torch.randn(2, 3)
    assert torch.equal(ModuleCaller(model)(params, {}, x), _reference(model, params, {}, x))

    assert bind(nn.LazyLinear(2)) is None  # no parameters to bind yet
    with warnings.catch_warnings():  # torch.jit.script is deprecated; scripted modules still exist
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(nn.Linear(2, 2))
    assert bind(scripted) is None


class _TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(5, 3)
        self.head = nn.Linear(3, 5, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids))


def _grads(fn: Any, params: dict[str, torch.Tensor], *args: Any) -> dict[str, torch.Tensor]:
    live = {name: p.detach().requires_grad_() for name, p in params.items()}
    return dict(zip(live, torch.autograd.grad(fn(live, *args).sum(), list(live.values())), strict=True))


def test_weights_tied_or_untied_after_the_caller_was_made_count() -> None:
    torch.manual_seed(0)
    model = _TinyLM()
    caller = ModuleCaller(model)
    ids = torch.tensor([[0, 1, 2]])

    def check() -> None:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        got = _grads(lambda p, x: caller(p, {}, x), params, ids)
        want = _grads(lambda p, x: _reference(model, p, {}, x), params, ids)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[name], want[name]) for name in want)

    check()
    model.head.weight = model.emb.weight  # tied afterwards (Hugging Face's tie_weights)
    check()  # one name now feeds both slots: emb's gradient has head's share in it
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())  # and untied again
    check()


def test_what_functional_call_refuses_or_ties_goes_to_functional_call() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"not an instance of torch\.Tensor"):
        ModuleCaller(layer)({"weight": [[1.0, 0.0], [0.0, 1.0]]}, {}, torch.ones(1, 2))
    assert all(p is layer._parameters[n] for n, p in layer.named_parameters())  # put back

    class Both(nn.Module):  # one tensor as a parameter and as a buffer: functional_call ties them
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(1))
            self.register_buffer("b", self.w)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.w + self.b

    both = Both()
    assert bind(both) is None
    params = {"w": torch.full((1,), 3.0)}
    assert torch.equal(
        ModuleCaller(both)(params, {}, torch.ones(1)), _reference(both, params, {}, torch.ones(1))
    )
    assert bind(nn.DataParallel(nn.Linear(1, 1))) is None  # functional_call refuses it, and says so


def test_a_tie_through_a_new_slot_counts_and_a_buffer_reassigned_in_forward_does_not_rebind() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3, bias=False))
    caller = ModuleCaller(model)
    x = torch.randn(2, 3)

    def check() -> None:
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        got = _grads(lambda p, v: caller(p, {}, v), params, x)
        want = _grads(lambda p, v: _reference(model, p, {}, v), params, x)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)

    # Both ties keep the parameter names as they were: only the slots tell.
    names = [n for n, _ in model.named_parameters()]
    check()
    model.append(nn.Linear(3, 3, bias=False))
    model[3].weight = model[2].weight  # a new submodule, tied to a bound weight
    check()
    model[2].bias = model[0].bias  # a None slot (bias=False) filled with another layer's bias
    check()
    assert [n for n, _ in model.named_parameters()] == names
    model[3].bias = nn.Parameter(torch.randn(3))  # a new parameter: bound again, not left to functional_call
    check()
    assert "3.bias" in caller._bound.params

    class Counter(nn.Module):  # reassigns a buffer on every forward (not an in-place update)
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, v: torch.Tensor) -> torch.Tensor:
            self.calls = self.calls + 1
            return self.lin(v)

    counter = Counter()
    caller = ModuleCaller(counter)
    bound = caller._bound
    params = {n: p.detach() for n, p in counter.named_parameters()}
    for _ in range(3):
        caller(params, {}, torch.ones(1, 2))
    assert counter.calls.item() == 3.0
    assert caller._bound is bound  # the slot got a tensor of its own: nothing to bind again


def test_a_submodule_registered_as_none_and_filled_later_with_a_tied_head_counts() -> None:
    class OptionalHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 3)
            self.register_module("head", None)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            h = self.emb(ids)
            return h @ torch.ones(3, 5) if self.head is None else self.head(h)

    torch.manual_seed(0)
    model = OptionalHead()
    caller = ModuleCaller(model)
    head = nn.Linear(3, 5, bias=False)
    head.weight = model.emb.weight
    model.head = head  # the names stay ["emb.weight"]: only the filled entry tells
    params = {n: p.detach() + 0.5 for n, p in model.named_parameters()}
    ids = torch.tensor([[0, 1, 2]])
    assert list(params) == ["emb.weight"]
    assert torch.equal(caller(params, {}, ids), _reference(model, params, {}, ids))
