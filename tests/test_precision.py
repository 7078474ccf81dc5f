"""Mixed precision on tiny tensors (bf16/fp16 autocast is ~50x slower than fp32 on this CPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


@settings(max_examples=15)
@given(st.sampled_from(["bf16", "fp16"]), st.integers(0, 1000))
def test_mixed_precision_loss_is_close_to_fp32(precision: str, seed: int) -> None:
    import faccel

    torch.manual_seed(seed)
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    reference = torch.nn.functional.mse_loss(_tiny(seed)(x), y)
    model = faccel.prepare(faccel.DistState(precision=precision), _tiny(seed))
    out = model(x)
    assert out.dtype == torch.float32  # handed back in full precision
    loss = torch.nn.functional.mse_loss(out, y)
    torch.testing.assert_close(loss, reference, rtol=3e-2, atol=3e-2)
    # and the forward really ran in low precision
    assert not torch.equal(loss, reference)


def test_autocast_context_covers_code_outside_the_model() -> None:
    import faccel

    a, b = torch.ones(2, 2), torch.ones(2, 2)
    with faccel.autocast(faccel.DistState(precision="fp16")):
        assert (a @ b).dtype == torch.float16
    with faccel.autocast(faccel.DistState(precision="no")):
        assert (a @ b).dtype == torch.float32


def _fp16_setup():
    import faccel

    dist = faccel.DistState(precision="fp16")
    model = _tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = faccel.prepare(dist, model, optimizer, scheduler)
    return dist, model, optimizer, scheduler, faccel.grad_scaler(dist, init_scale=1024.0)


def test_fp16_skips_the_step_on_inf_and_the_scheduler_waits() -> None:
    import faccel

    dist, model, optimizer, scheduler, scaler = _fp16_setup()
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    before = [p.detach().clone() for p in model.parameters()]

    optimizer.zero_grad()
    faccel.backward(dist, torch.nn.functional.mse_loss(model(x), y), scaler=scaler)
    next(iter(model.parameters())).grad[0, 0] = float("inf")  # an overflow
    stepped = faccel.optimizer_step(dist, optimizer, scaler=scaler, scheduler=scheduler)
    assert stepped is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scheduler.last_epoch == 0 and optimizer.param_groups[0]["lr"] == 0.1
    assert scaler.get_scale() == 512.0  # backed off

    optimizer.zero_grad()
    faccel.backward(dist, torch.nn.functional.mse_loss(model(x), y), scaler=scaler)
    assert faccel.optimizer_step(dist, optimizer, scaler=scaler, scheduler=scheduler) is True
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scheduler.last_epoch == 1 and optimizer.param_groups[0]["lr"] == 0.05


def test_fp16_scaled_gradients_match_fp32_after_unscaling() -> None:
    import faccel

    dist, model, optimizer, _, scaler = _fp16_setup()
    x, y = torch.randn(4, 4), torch.randn(4, 1)
    faccel.backward(dist, torch.nn.functional.mse_loss(model(x), y), scaler=scaler)
    reference = _tiny()
    torch.nn.functional.mse_loss(reference(x), y).backward()
    norm = faccel.clip_grad_norm(dist, model, 1e9, scaler=scaler, optimizer=optimizer)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
    torch.testing.assert_close(norm, expected, rtol=2e-2, atol=1e-3)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got.grad, want.grad, rtol=5e-2, atol=5e-3)


def test_fp16_without_a_scaler_is_refused() -> None:
    import faccel

    dist = faccel.DistState(precision="fp16")
    w = torch.ones(1, requires_grad=True)
    with pytest.raises(faccel.errors.PrecisionError, match="grad_scaler"):
        faccel.backward(dist, w.sum())
    with pytest.raises(faccel.errors.PrecisionError, match="optimizer="):
        faccel.clip_grad_norm(dist, [w], 1.0, scaler=faccel.grad_scaler(dist))


def test_a_disabled_scaler_changes_nothing() -> None:
    import faccel

    dist = faccel.DistState(precision="bf16")
    scaler = faccel.grad_scaler(dist)
    w = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([w], lr=1.0)
    faccel.backward(dist, (3 * w).sum(), scaler=scaler)
    assert w.grad.item() == 3.0
    assert faccel.optimizer_step(dist, opt, scaler=scaler) is True and w.item() == -2.0


def test_precision_comes_from_the_environment() -> None:
    import faccel

    assert faccel.detect({"FACCEL_PRECISION": "fp16"}).precision == "fp16"
