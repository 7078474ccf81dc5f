"""A meta-built model in one process: materialized whole, bitwise the eager build; refusals by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import faccel
from faccel.errors import ArgumentValueError, PrepareError
from tests.distributed.meta_workers import TinyGPT, eager, full_state, on_meta


def test_one_process_prepare_of_a_meta_model_equals_the_eager_build() -> None:
    dist = faccel.detect({})
    want = full_state(faccel.prepare(dist, eager()))
    torch.manual_seed(0)
    model = faccel.prepare(dist, on_meta())
    got = full_state(model)
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[name], got[name]) for name in want)
    assert model.head.weight is model.embed.weight  # still tied


def test_a_callable_init_sees_each_module_s_own_tensors_whole() -> None:
    def init(module: nn.Module) -> None:
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            tensor.fill_(0.5)

    model = faccel.prepare(faccel.detect({}), on_meta(), init=init)
    assert all(bool((p == 0.5).all()) for p in model.parameters())


def test_a_partly_meta_model_is_refused_by_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(PrepareError, match="partly on the meta device"):
        faccel.prepare(faccel.detect({}), model)


def test_a_module_without_reset_parameters_is_refused_under_reset() -> None:
    class Bare(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        model = Bare()
    with pytest.raises(PrepareError, match="has none and owns"):
        faccel.prepare(faccel.detect({}), model)


def test_a_tensor_the_initializer_leaves_unset_is_refused() -> None:
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(PrepareError, match="left 'bias' unset"):
        faccel.prepare(faccel.detect({}), model, init=lambda m: m.weight.zero_())


def test_an_unknown_init_is_refused() -> None:
    with pytest.raises(ArgumentValueError, match="init must be"):
        faccel.prepare(faccel.detect({}), nn.Linear(2, 2), init="zeros")


def test_init_empty_still_computes_non_persistent_buffers() -> None:
    model = faccel.prepare(faccel.detect({}), on_meta(), init="empty")
    assert torch.equal(model.rotary.inv_freq, TinyGPT().rotary.inv_freq)
