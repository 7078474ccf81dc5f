"""Context parallelism's data on the CPU: the head-tail slices as laws, the refusal where torch cannot run it.

The laws: every token of a sequence sits on exactly one context rank; every rank holds the same number
of tokens and the same causal attention work (the keys its queries see, ``sum(position + 1)``); the
inverse puts every rank's slice back in order; the slices are those of torch's own head-tail load
balancer. The end-to-end runs need CUDA: tests/test_context_cuda.py (marked ``cuda``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

# (ranks, length): a context size and a sequence length it can cut into 2 x ranks equal chunks
sizes = st.integers(min_value=1, max_value=16).flatmap(
    lambda ranks: st.tuples(
        st.just(ranks), st.integers(min_value=0, max_value=12).map(lambda k: 2 * ranks * k)
    )
)


@given(sizes)
def test_every_token_on_exactly_one_rank_with_even_causal_work(case: tuple[int, int]) -> None:
    import faccel

    ranks, length = case
    slices = [faccel.context_positions(length, rank=r, ranks=ranks).tolist() for r in range(ranks)]
    assert sorted(p for s in slices for p in s) == list(range(length))  # each position once
    assert {len(s) for s in slices} == {length // ranks}
    assert len({sum(p + 1 for p in s) for s in slices}) == 1  # the same causal work on every rank


@given(sizes, st.integers(min_value=1, max_value=3), st.integers(min_value=0, max_value=2))
def test_the_inverse_restores_the_order(case: tuple[int, int], batch: int, dim: int) -> None:
    import faccel

    ranks, length = case
    shape = [batch, 3, 2]
    shape.insert(dim, length)
    x = torch.arange(torch.Size(shape).numel()).view(shape)
    pieces = [faccel.context_shard(x, rank=r, ranks=ranks, dim=dim) for r in range(ranks)]
    assert torch.equal(faccel.context_unshard(pieces, dim=dim), x)


@given(sizes)
def test_ids_labels_and_positions_stay_aligned(case: tuple[int, int]) -> None:
    import faccel

    ranks, length = case
    ids = torch.arange(length + 1).view(1, -1) * 10
    # the labels shifted over the whole sequence, before slicing
    batch = {"ids": ids[:, :-1], "labels": ids[:, 1:], "note": "kept"}
    for r in range(ranks):
        part = faccel.context_shard(batch, rank=r, ranks=ranks)
        positions = faccel.context_positions(length, rank=r, ranks=ranks)
        assert part["note"] == "kept"
        assert torch.equal(part["ids"][0], positions * 10)  # the token at each position
        assert torch.equal(part["labels"][0], (positions + 1) * 10)  # its target: the next token


@given(sizes)
def test_the_slices_are_torchs_head_tail_load_balancer(case: tuple[int, int]) -> None:
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    import faccel

    ranks, length = case
    if length == 0:
        return
    order = _HeadTailLoadBalancer(length, ranks, "cpu")._generate_indices().flatten()
    ours = torch.cat([faccel.context_positions(length, rank=r, ranks=ranks) for r in range(ranks)])
    assert torch.equal(ours, order)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda f: f.context_positions(6, rank=0, ranks=2), "pad every sequence to a multiple of 4"),
        (lambda f: f.context_positions(8, rank=2, ranks=2), r"rank must be an int in \[0, 2\)"),
        (lambda f: f.context_shard((torch.zeros(1, 4), torch.zeros(1, 8)), rank=0, ranks=1), "one"),
        (lambda f: f.context_unshard([torch.zeros(1, 4), torch.zeros(1, 2)]), "one even length"),
    ],
)
def test_a_slice_that_cannot_be_made_is_refused(call: object, match: str) -> None:
    import faccel

    with pytest.raises(faccel.errors.ArgumentValueError, match=match):
        call(faccel)  # type: ignore[operator]


def test_prepare_refuses_context_parallelism_on_the_cpu_by_name() -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=1, world_size=4, layout=faccel.Layout(shard=2, context=2))
    assert dist.data_world_size == 2 and dist.parallel.members("context", 1) == (0, 1)
    with pytest.raises(faccel.errors.PrepareError, match=r"runs on 'cuda' only.*Run on CUDA GPUs"):
        faccel.prepare(dist, torch.nn.Linear(2, 2))
    with pytest.raises(faccel.errors.PrepareError, match="context_parallel"), faccel.context_attention(dist):
        pass
    # a context of 1 is every layout before it: nothing refused, nothing changed
    with faccel.context_attention(faccel.detect({})):
        pass
