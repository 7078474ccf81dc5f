"""A meta-built model in one process and on 2 gloo ranks (DDP, FSDP2): the eager build bitwise, or refused."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import faccel
from faccel.errors import ArgumentValueError, PrepareError
from tests.distributed import harness, materialize_workers
from tests.distributed.materialize_workers import (
    DTYPES,
    BuffersOnly,
    Computed,
    DeclaredEmbedFirst,
    DeclaredHeadFirst,
    DeclaredReverse,
    HeadFirst,
    SharedBuffer,
    Tables,
    same_as_eager,
)
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


# the holes of the meta path, each refused by name or exact.


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_non_float_buffer_the_reset_leaves_unset_is_refused(dtype: str) -> None:
    """Before: an int64 table held addresses, a bool mask came out all True, a complex one zeros."""
    with pytest.raises(PrepareError, match="left 'table' unset"):
        faccel.prepare(faccel.detect({}), materialize_workers.on_meta(lambda: Tables(DTYPES[dtype], "none")))


def test_a_half_written_integer_buffer_is_refused() -> None:
    with pytest.raises(PrepareError, match="left 'table' unset"):
        faccel.prepare(faccel.detect({}), materialize_workers.on_meta(lambda: Tables(torch.int64, "half")))


def test_non_float_buffers_the_reset_computes_are_the_eager_build_s() -> None:
    result = same_as_eager(faccel.detect({}), Computed)
    assert result["equal"] == result["names"]
    assert "norm.num_batches_tracked" in result["names"]
    # the generator is where the eager build left it (the inits that ran twice drew the same numbers)
    after = torch.rand(3)
    materialize_workers.eager(Computed)
    assert torch.equal(after, torch.rand(3))


class _Replaced(nn.Module):
    """reset_parameters assigns new tensors (a causal mask made anew) instead of filling them."""

    def __init__(self, size: int = 3) -> None:
        super().__init__()
        self.size = size
        self.register_buffer("mask", torch.ones(3, 3, dtype=torch.bool).tril())

    def reset_parameters(self) -> None:
        self.mask = torch.ones(self.size, self.size, dtype=torch.bool).tril()


def test_an_initializer_may_replace_a_tensor_with_one_of_its_shape_and_dtype() -> None:
    model = faccel.prepare(faccel.detect({}), materialize_workers.on_meta(_Replaced))
    assert torch.equal(model.mask, _Replaced().mask)


def test_a_replacement_of_another_shape_is_refused() -> None:
    with pytest.raises(PrepareError, match=r"replaced 'mask' with a tensor of shape \[4, 4\]"):
        faccel.prepare(faccel.detect({}), materialize_workers.on_meta(lambda: _Replaced(size=4)))


@pytest.mark.parametrize("build", [DeclaredHeadFirst, DeclaredEmbedFirst, DeclaredReverse])
def test_declared_ties_are_bitwise_in_either_order_and_direction(build: type) -> None:
    """Before: the head registered first kept the head's draw; the eager build keeps the embedding's."""
    result = same_as_eager(faccel.detect({}), build)
    assert result["equal"] == result["names"]
    model = faccel.unwrap_model(result["model"])
    assert model.head.weight is model.embed.weight


def test_an_undeclared_tie_whose_owners_draw_differently_is_refused() -> None:
    with pytest.raises(PrepareError, match=r"_tied_weights_keys = \{'head.weight': 'embed.weight'\}"):
        faccel.prepare(faccel.detect({}), materialize_workers.on_meta(HeadFirst))


def test_a_model_with_buffers_and_no_parameters_is_materialized() -> None:
    """Before: torch's raw NotImplementedError: Cannot copy out of meta tensor."""
    result = same_as_eager(faccel.detect({}), BuffersOnly)
    assert result["equal"] == result["names"]
    model = result["model"]
    assert model.a.noise is model.b.noise


def test_a_buffer_two_modules_share_stays_one_tensor() -> None:
    """Before: two tensors with different values (each owner's own draw)."""
    result = same_as_eager(faccel.detect({}), SharedBuffer)
    assert result["equal"] == result["names"]
    model = result["model"]
    assert model.a.noise is model.b.noise


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_the_holes_on_two_gloo_ranks(strategy: str) -> None:
    """Each hole under FSDP2 and DDP on 2 real gloo processes: refused by name on every rank, or exact."""
    ranks = harness.run(materialize_workers.holes_run, world_size=2, timeout=180, strategy=strategy)
    for r in ranks:
        for name in sorted(DTYPES):
            assert (
                r[f"unset_{name}"].startswith("PrepareError:") and "left 'table' unset" in r[f"unset_{name}"]
            )
        assert "left 'table' unset" in r["half_int64"]
        names, equal = r["computed"]
        assert equal == names
        for build in ("DeclaredHeadFirst", "DeclaredEmbedFirst", "DeclaredReverse"):
            names, equal, tied = r[build]
            assert equal == names and tied, build
        assert "_tied_weights_keys" in r["undeclared"]
        flat = r["flat"]
        assert flat["equal"] == flat["names"] and flat["tied"]
        assert flat["eager_equal"] == flat["names"] and flat["eager_tied"]
        if strategy == "fsdp":  # before: ValueError: zip() argument 2 is longer than argument 1
            for case in ("split_meta", "split_eager"):
                assert r[case].startswith("PrepareError:") and "different FSDP2 units" in r[case], r[case]
            names, equal, shared = r["buffers_only"]
            assert equal == names and shared
        else:
            assert "no parameter that requires a gradient" in r["buffers_only"], r["buffers_only"]
        names, equal, shared = r["shared_buffer"]
        assert equal == names and shared
    assert ranks[0]["flat"]["loss"] == ranks[1]["flat"]["loss"]


def test_a_tp_plan_that_splits_a_tied_weight_is_refused_by_name() -> None:
    """Before: raw ValueError: zip() argument 2 is longer than argument 1 (the tie split into two)."""
    ranks = harness.run(materialize_workers.tp_tie_run, world_size=2, timeout=120)
    for r in ranks:
        for case in ("split_meta", "split_eager"):
            assert r[case].startswith("PrepareError:") and "tp_plan key 'head'" in r[case], r[case]
        names, equal, tied = r["kept"]
        assert equal == names and tied


class _RealPart(nn.Module):
    """A complex buffer whose reset_parameters writes the real parts only."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("rotations", torch.ones(4, dtype=torch.complex64))

    def reset_parameters(self) -> None:
        self.rotations.real.fill_(1.0)


def test_a_complex_buffer_written_in_its_real_parts_only_is_refused() -> None:
    with pytest.raises(PrepareError, match="left 'rotations' unset"):
        faccel.prepare(faccel.detect({}), materialize_workers.on_meta(_RealPart))


class _Aliased(nn.Module):
    """One parameter under two names of one module, written through the first."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(3))
        self.alias = self.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)


def test_a_tensor_one_module_holds_under_two_names_is_one_stand_in() -> None:
    """Before: a stand-in per name, the alias's left NaN and refused, though the eager build is fine."""
    result = same_as_eager(faccel.detect({}), _Aliased)
    assert result["equal"] == result["names"]
    assert result["model"].alias is result["model"].weight


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_a_meta_built_model_under_deepspeed_is_the_eager_build() -> None:
    """Before: torch's raw NotImplementedError: Cannot copy out of meta tensor (from DeepSpeed's engine)."""
    ranks = harness.run(materialize_workers.deepspeed_run, world_size=2, timeout=300)
    for r in ranks:
        assert r["equal"] == r["names"]  # after one step of ZeRO-3: the optimizer stepped the engine's


_ALL_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64]
_ALL_DTYPES += [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool]


@settings(max_examples=30, deadline=None)
@given(dtype=st.sampled_from(_ALL_DTYPES), fill=st.sampled_from(["whole", "half", "none"]))
def test_law_a_meta_build_is_the_eager_build_or_refused_whatever_the_dtype(
    dtype: torch.dtype, fill: str
) -> None:
    """Law: a buffer of any dtype is the eager build's bit for bit when the reset computes it whole,
    and refused by name when the reset leaves any of it unset."""
    build = lambda: Tables(dtype, fill)  # noqa: E731
    if fill == "whole":
        result = same_as_eager(faccel.detect({}), build)
        assert result["equal"] == result["names"]
    else:
        with pytest.raises(PrepareError, match="left 'table' unset"):
            faccel.prepare(faccel.detect({}), materialize_workers.on_meta(build))


def _tied(head_first: bool, from_embed: bool, declared: bool) -> type:
    """A model class with an embedding and a head tied one way, registered in one order, declared or not."""

    def __init__(self: nn.Module) -> None:
        nn.Module.__init__(self)
        for name in ("head", "embed") if head_first else ("embed", "head"):
            setattr(self, name, nn.Linear(8, 11, bias=False) if name == "head" else nn.Embedding(11, 8))
        if from_embed:
            self.head.weight = self.embed.weight
        else:
            self.embed.weight = self.head.weight

    keys = {"head.weight": "embed.weight"} if from_embed else {"embed.weight": "head.weight"}
    return type(
        "Tied", (nn.Module,), {"__init__": __init__, **({"_tied_weights_keys": keys} if declared else {})}
    )


@settings(max_examples=16, deadline=None)
@given(head_first=st.booleans(), from_embed=st.booleans(), declared=st.booleans())
def test_law_a_tie_is_the_eager_build_in_any_order_and_direction_or_refused(
    head_first: bool, from_embed: bool, declared: bool
) -> None:
    """Law: declared, a tie is bitwise the eager build in either registration order and direction;
    undeclared (the owners draw differently), it is refused by name, never the wrong draw."""
    build = _tied(head_first, from_embed, declared)
    if declared:
        result = same_as_eager(faccel.detect({}), build)
        assert result["equal"] == result["names"]
        assert result["model"].head.weight is result["model"].embed.weight
    else:
        with pytest.raises(PrepareError, match="_tied_weights_keys"):
            faccel.prepare(faccel.detect({}), materialize_workers.on_meta(build))
