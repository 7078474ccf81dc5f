"""Property: restore either loads the checkpoint exactly or raises a CheckpointError and changes nothing.

Saved and target objects are drawn to differ in structure (model width,
optimizer kind, param-group split, scheduler kind and SequentialLR length,
grad scaler, extras names and kinds, a crafted optimizer step); restoring
one into the other must give back exactly what was saved, or refuse with a
CheckpointError naming a checkpoint file, every target object bit for bit as
it was.
"""

from __future__ import annotations

import tempfile
from typing import Any

import attrs
import pytest
import torch
from hypothesis import event, given, settings
from torch import nn

from tests import strategies
from tests.distributed import checkpoint_workers as cw

FILES = ("manifest.json", "state.json", "model.safetensors", "optimizer.safetensors", "extras.safetensors")


pytestmark = pytest.mark.usefixtures("keep_global_generators")  # restore sets the global generators


def _groups(model: nn.Module, split: int) -> Any:
    params = list(model.parameters())
    return params if split == 0 else [{"params": params[:split]}, {"params": params[split:], "lr": 0.05}]


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.AdamW(params, lr=0.01, amsgrad=True)


def _scheduler(kind: str | None, optimizer: torch.optim.Optimizer) -> Any:
    lr = torch.optim.lr_scheduler
    if kind == "step":
        return lr.StepLR(optimizer, step_size=2)
    if kind == "plateau":
        return lr.ReduceLROnPlateau(optimizer, patience=1)
    if kind is not None:  # sequentialN
        parts = int(kind[-1])
        schedulers = [lr.ConstantLR(optimizer, factor=0.5, total_iters=2)]
        schedulers += [lr.ExponentialLR(optimizer, gamma=0.9) for _ in range(parts - 1)]
        return lr.SequentialLR(optimizer, schedulers, milestones=[2 * (i + 1) for i in range(parts - 1)])
    return None


def _extra(kind: str, model: nn.Module, seed: int) -> Any:
    if kind.startswith("tensor"):
        return torch.full((int(kind[-1]),), float(seed))
    if kind == "count":
        return seed
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(_groups(model, int(kind[-1])), lr=0.01)


def _build(spec: dict[str, Any], seed: int) -> Any:
    """The spec's TrainState, trained one step (every optimizer, scheduler and scaler has state)."""
    import faccel

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, spec["width"]), nn.Linear(spec["width"], 2))
    optimizer = _optimizer(spec["optimizer"], _groups(model, spec["split"]))
    scheduler = _scheduler(spec["scheduler"], optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1) if spec["scaler"] else None
    extras = {name: _extra(kind, model, seed) for name, kind in spec["extras"].items()}
    optimizers = [optimizer, *(v for v in extras.values() if isinstance(v, torch.optim.Optimizer))]
    for each in optimizers:
        each.zero_grad()
        loss = model(torch.full((2, 3), float(seed + 1))).sum()
        if scaler is not None and each is optimizer:
            scaler.scale(loss).backward()
            scaler.step(each)
            scaler.update()
        else:
            loss.backward()
            each.step()
    if scheduler is not None:
        scheduler.step(1.0) if spec["scheduler"] == "plateau" else scheduler.step()
    if spec["step_abc"]:
        for entry in optimizer.state.values():
            entry["step"] = "abc"
    state = faccel.TrainState.create(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, extras=extras
    )
    return attrs.evolve(state, step=seed + 1, epoch=seed, position=seed + 2)


@settings(max_examples=40, deadline=None)
@given(specs=strategies.restore_specs())
def test_restore_loads_exactly_or_changes_nothing(specs: tuple[dict[str, Any], dict[str, Any]]) -> None:
    import faccel

    saved_spec, target_spec = specs
    dist = faccel.detect({})
    with tempfile.TemporaryDirectory() as root:
        saved = _build(saved_spec, seed=0)
        expected = cw.observe(saved)
        faccel.checkpoint(dist, saved, root)
        target = _build(target_spec, seed=1)
        before = cw.observe(target)
        try:
            restored = faccel.restore(dist, target, root)
        except faccel.errors.CheckpointError as error:
            message = str(error).replace(root, "<root>")
            event("refused")
            assert any(file in message for file in FILES), message
            cw.assert_same(cw.observe(target), before)
        else:
            event("restored")
            cw.assert_same(cw.observe(restored), expected)
