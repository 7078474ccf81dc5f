"""``backward(..., items=n)``: loss by item count, its named errors, and torch's own keywords."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

import faccel
from faccel.errors import AccumulationError, ArgumentError, ArgumentValueError
from tests import strategies


def _epoch(lengths: list[list[int]]) -> list[torch.Tensor]:
    """Per batch, the tokens' values (each sequence's tokens are 1..len, scaled by its batch number)."""
    return [
        torch.tensor([float(b + 1) * (t + 1) for seq in batch for t in range(seq)], dtype=torch.float64)
        for b, batch in enumerate(lengths)
    ]


@settings(max_examples=40, deadline=None)
@given(strategies.token_groups())
def test_every_group_gets_the_gradient_of_its_token_mean(case: tuple[int, list[list[int]]]) -> None:
    # Law: after a group's syncing backward, grad = d/dw (sum of the group's token losses / its tokens).
    k, lengths = case
    dist = faccel.DistState(accumulation_steps=k)
    w = torch.ones((), dtype=torch.float64, requires_grad=True)
    batches = _epoch(lengths)
    for micro, values in faccel.micro_batches(dist, batches, items=len):
        faccel.backward(dist, (w * values).sum(), micro=micro, items=len(values))
        if micro.sync:
            first = micro.index - micro.index % k
            group = torch.cat(batches[first : micro.index + 1])
            want = group.sum() / max(len(group), 1)
            torch.testing.assert_close(w.grad, want, rtol=1e-12, atol=1e-12)
            w.grad = None


def test_fp16_scaling_and_clipping_see_the_token_mean() -> None:
    dist = faccel.DistState(accumulation_steps=2, precision="fp16")
    scaler = faccel.grad_scaler(dist, init_scale=1024.0)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = [torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0]])]
    for micro, x in faccel.micro_batches(dist, batches, items=len):
        faccel.backward(dist, model(x).sum(), micro=micro, items=len(x), scaler=scaler)
    norm = faccel.clip_grad_norm(dist, model, 0.5, scaler=scaler, optimizer=optimizer)
    assert norm.item() == pytest.approx(2.0)  # (1 + 2 + 3) / 3 tokens, before clipping
    assert model.weight.grad.item() == pytest.approx(0.5)


def test_a_group_mixing_items_and_means_is_a_named_error() -> None:
    dist = faccel.DistState(accumulation_steps=2)
    w = torch.ones((), requires_grad=True)
    micro, _ = next(faccel.micro_batches(dist, [[1.0], [2.0]], items=len))
    with pytest.raises(AccumulationError, match="mixes losses by item count"):
        faccel.backward(dist, w * 2, micro=micro)
    plain, _ = next(faccel.micro_batches(dist, [[1.0], [2.0]]))
    with pytest.raises(AccumulationError, match="items=count"):
        faccel.backward(dist, w * 2, micro=plain, items=1)
    with pytest.raises(AccumulationError, match="items=count"):
        faccel.backward(faccel.DistState(), w * 2, items=1)
    with pytest.raises(ArgumentValueError, match=r"in \[0, 2\]"):
        faccel.backward(dist, w * 2, micro=micro, items=3)


def test_a_count_that_is_not_a_count_is_a_named_error() -> None:
    dist = faccel.DistState(accumulation_steps=2)
    with pytest.raises(ArgumentValueError, match="count >= 0"):
        list(faccel.micro_batches(dist, [[1.0]], items=lambda batch: -1))
    with pytest.raises(ArgumentValueError, match="count >= 0"):
        list(faccel.micro_batches(dist, [[1.0]], items=lambda batch: 1.5))
    counted = list(faccel.micro_batches(dist, [torch.ones(3)], items=lambda batch: torch.tensor(3)))
    assert counted[0][0].items == 3


def test_unknown_keywords_are_named_and_torchs_own_pass_through() -> None:
    dist = faccel.detect({})
    w = torch.ones(2, requires_grad=True)
    loss = (w * w).sum()
    with pytest.raises(ArgumentError, match=r"unknown keyword\(s\) \['item'\]"):
        faccel.backward(dist, loss, item=3)
    faccel.backward(dist, loss, retain_graph=True)
    faccel.backward(dist, loss, inputs=[w])  # retain_graph reached torch: a second backward works
    assert w.grad.tolist() == [4.0, 4.0]
