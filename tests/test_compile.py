"""torch.compile as a first-class path: both orders, checkpoints between compiled and eager models.

The tests compile with the ``aot_eager`` backend (TorchDynamo and AOTAutograd, no C++ build), which
runs the same capture faccel's wrappers must survive in seconds; docs/training-loop.md gives the
inductor backend's start-up cost as measured.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.distributed import harness

BACKEND = "aot_eager"


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _train(dist: object, order: str, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import faccel

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if order == "compile, then prepare":
        model, optimizer = faccel.prepare(dist, torch.compile(model, backend=BACKEND), optimizer)
    elif order == "prepare, then compile":
        model, optimizer = faccel.prepare(dist, model, optimizer)
        model = torch.compile(model, backend=BACKEND)
    else:
        model, optimizer = faccel.prepare(dist, model, optimizer)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("order", ["compile, then prepare", "prepare, then compile"])
def test_compiled_training_matches_eager_in_either_order(order: str) -> None:
    import faccel

    dist = faccel.detect({})
    eager, _ = _train(dist, "eager")
    compiled, _ = _train(dist, order)
    assert type(faccel.unwrap_model(compiled)) is torch.nn.Sequential
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_checkpoints_move_between_compiled_and_eager_models(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    compiled, optimizer = _train(dist, "prepare, then compile")
    saved = faccel.TrainState.create(model=compiled, optimizer=optimizer, step=3)
    folder = faccel.checkpoint(dist, saved, tmp_path / "from-compiled")
    keys = {p.name for p in folder.iterdir()}
    assert "model.safetensors" in keys
    eager = faccel.prepare(dist, _mlp())
    fresh_optimizer = torch.optim.SGD(eager.parameters(), lr=0.1)
    state = faccel.restore(dist, faccel.TrainState.create(model=eager, optimizer=fresh_optimizer), folder)
    assert state.step == 3
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        assert torch.equal(a, b)
    # and back: an eager checkpoint into a compiled model
    faccel.checkpoint(dist, faccel.TrainState.create(model=eager, optimizer=None, step=4), tmp_path / "eager")
    target = torch.compile(faccel.prepare(dist, _mlp()), backend=BACKEND)
    faccel.restore(dist, faccel.TrainState.create(model=target, optimizer=None), tmp_path / "eager")
    for a, b in zip(eager.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)
    saved_model = faccel.save_model(dist, compiled, tmp_path / "model")
    from safetensors import safe_open

    with safe_open(str(saved_model / "model.safetensors"), "pt") as weights:
        assert sorted(weights.keys()) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # no _orig_mod.


def _distributed(strategy: str, order: str) -> list[list[float]]:
    import faccel

    dist = faccel.detect(strategy=strategy)
    model, _ = _train(dist, order)
    params = []
    for p in model.parameters():
        tensor = p.full_tensor() if hasattr(p, "full_tensor") else p
        params.append(tensor.detach().flatten().tolist())
    return params


@pytest.mark.parametrize(
    ("strategy", "order"),
    [("ddp", "compile, then prepare"), ("ddp", "prepare, then compile"), ("fsdp", "prepare, then compile")],
)
def test_compile_with_ddp_and_fsdp2_on_two_processes_matches_eager(strategy: str, order: str) -> None:
    eager = harness.run(_distributed, world_size=2, strategy=strategy, order="eager")
    compiled = harness.run(_distributed, world_size=2, strategy=strategy, order=order, timeout=180)
    assert compiled[0] == compiled[1]  # the ranks agree
    for a, b in zip(eager[0], compiled[0], strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("order", ["compile, then prepare", "prepare, then compile"])
def test_activation_checkpointing_under_compile_gives_the_eager_gradients(order: str) -> None:
    """Dynamo captures torch.utils.checkpoint (non-reentrant) as one region; the masks are kept."""
    import faccel
    from tests.distributed.meta_workers import Block, TinyGPT

    dist = faccel.detect({})
    tokens = torch.arange(24).reshape(2, 12) % 11
    grads = []
    for selector, how in ((None, "eager"), (Block, order)):
        torch.manual_seed(0)
        module = TinyGPT(width=16)
        if how == "compile, then prepare":
            model = faccel.prepare(
                dist, torch.compile(module, backend=BACKEND), activation_checkpointing=selector
            )
        elif how == "prepare, then compile":
            model = torch.compile(
                faccel.prepare(dist, module, activation_checkpointing=selector), backend=BACKEND
            )
        else:
            model = faccel.prepare(dist, module)
        torch.manual_seed(1)
        faccel.backward(dist, model(tokens).square().mean())
        grads.append([p.grad for p in module.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
