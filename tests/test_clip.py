from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st


@given(
    st.lists(st.integers(1, 6), min_size=1, max_size=4),
    st.floats(0.01, 10.0),
    st.sampled_from([1.0, 2.0, 3.0, math.inf]),
    st.integers(0, 10_000),
)
def test_clip_grad_norm_equals_torch(shapes: list[int], max_norm: float, norm_type: float, seed: int) -> None:
    import faccel

    torch.manual_seed(seed)
    grads = [torch.randn(n, 2) * 3 for n in shapes]
    ours = [torch.nn.Parameter(torch.zeros(n, 2)) for n in shapes]
    theirs = [torch.nn.Parameter(torch.zeros(n, 2)) for n in shapes]
    for p, q, g in zip(ours, theirs, grads, strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    norm = faccel.clip_grad_norm(faccel.DistState(), ours, max_norm, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type=norm_type)
    assert torch.equal(norm, expected)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(ours, theirs, strict=True))


def test_clip_takes_a_wrapped_model_and_honours_error_if_nonfinite() -> None:
    import faccel

    model = faccel.prepare(faccel.DistState(precision="bf16"), torch.nn.Linear(2, 1))
    for p in faccel.unwrap_model(model).parameters():
        p.grad = torch.full_like(p, float("nan"))
    with pytest.raises(RuntimeError, match="non-finite"):
        faccel.clip_grad_norm(faccel.DistState(), model, 1.0, error_if_nonfinite=True)


def test_clip_grad_value_equals_torch() -> None:
    import faccel

    g = torch.randn(5, 3) * 4
    a, b = torch.nn.Parameter(torch.zeros(5, 3)), torch.nn.Parameter(torch.zeros(5, 3))
    a.grad, b.grad = g.clone(), g.clone()
    faccel.clip_grad_value(faccel.DistState(), a, 0.5)
    torch.nn.utils.clip_grad_value_([b], 0.5)
    assert torch.equal(a.grad, b.grad)
