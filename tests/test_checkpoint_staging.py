"""Restore is validate-then-commit: a target that cannot take the checkpoint is left bit for bit as it was.

Each case saves a checkpoint of some objects and restores it into objects that
pass the structural checks (same classes, same keys) yet cannot load it: the
error is one CheckpointError naming the file and the field, and the model,
optimizer, scheduler, scaler, extras and generators are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from torch import nn

from tests.distributed import checkpoint_workers as cw

pytestmark = pytest.mark.usefixtures("keep_global_generators")  # restore sets the global generators


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))


def _trained(state: Any) -> Any:
    """One step of every optimizer in ``state``, so that each has state to save."""
    model = state.model
    extra = [value for value in state.extras.values() if isinstance(value, torch.optim.Optimizer)]
    optimizers = [state.optimizer, *extra]
    for optimizer in optimizers:
        optimizer.zero_grad()
        model(torch.ones(2, 3)).sum().backward()
        optimizer.step()
    if state.scheduler is not None:
        state.scheduler.step()
    return attrs.evolve(state, step=1)


def _sequential(optimizer: torch.optim.Optimizer, parts: int) -> Any:
    lr = torch.optim.lr_scheduler
    schedulers = [lr.ConstantLR(optimizer, factor=0.5, total_iters=2), lr.StepLR(optimizer, step_size=2)]
    schedulers += [lr.ExponentialLR(optimizer, gamma=0.9) for _ in range(parts - 2)]
    return lr.SequentialLR(optimizer, schedulers, milestones=[2 * (i + 1) for i in range(parts - 1)])


def _split(model: nn.Module, first: int) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [{"params": params[:first]}, {"params": params[first:], "lr": 0.5}]


def _sequential_state(seed: int, parts: int) -> Any:
    import faccel

    model = _model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=_sequential(optimizer, parts))


def _extra_optimizer_state(seed: int, first: int) -> Any:
    import faccel

    model = _model(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    extra = torch.optim.Adam(_split(model, first), lr=0.01)
    return faccel.TrainState.create(model=model, optimizer=optimizer, extras={"second": extra})


def _adam_state(seed: int) -> Any:
    import faccel

    model = _model(seed)
    return faccel.TrainState.create(model=model, optimizer=torch.optim.Adam(model.parameters(), lr=0.01))


def _step_abc(state: Any) -> Any:
    for entry in state.optimizer.state.values():
        entry["step"] = "abc"
    return state


CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any], str]] = {
    # name: (saved objects, target objects, field the error must name); the file is state.json
    "SequentialLR with one fewer scheduler": (
        lambda: _sequential_state(0, 3),
        lambda: _sequential_state(1, 2),
        "scheduler",
    ),
    "SequentialLR with one more scheduler": (  # loaded two of three: not an exact restore
        lambda: _sequential_state(0, 2),
        lambda: _sequential_state(1, 3),
        "scheduler",
    ),
    "extra optimizer split differently": (
        lambda: _extra_optimizer_state(0, 1),
        lambda: _extra_optimizer_state(1, 3),
        "extras['second']",
    ),
    "optimizer step 'abc'": (lambda: _step_abc(_trained(_adam_state(0))), lambda: _adam_state(1), "'step'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_target_that_cannot_load_is_refused_untouched(tmp_path: Path, case: str) -> None:
    import faccel

    make_saved, make_target, field = CASES[case]
    dist = faccel.detect({})
    saved = make_saved()
    if saved.step == 0:
        saved = _trained(saved)
    faccel.checkpoint(dist, saved, tmp_path)
    target = _trained(make_target())
    before = cw.observe(target)
    with pytest.raises(faccel.errors.CheckpointError) as error:
        faccel.restore(dist, target, tmp_path)
    message = str(error.value).replace(str(tmp_path), "<folder>")
    assert "state.json" in message, message
    assert field in message, message
    cw.assert_same(cw.observe(target), before)
