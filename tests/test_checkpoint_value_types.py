"""``restore`` checks optimizer and scheduler value types against the live objects'.

A ``state.json`` with ``lr="abc"`` or ``last_epoch="x"`` (edited and rehashed, or saved from objects
that held them) would restore, and the first ``optimizer.step()`` raise a raw ``TypeError``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import faccel
from faccel.errors import CheckpointError


def _state(seed: int) -> faccel.TrainState:
    torch.manual_seed(seed)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    return faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)


@pytest.mark.parametrize(
    ("where", "key", "value"),
    [
        ("group", "lr", "abc"),
        ("group", "betas", "ab"),
        ("group", "amsgrad", 3),
        ("scheduler", "last_epoch", "x"),
    ],
)
def test_a_value_of_another_type_is_refused_naming_it(
    tmp_path: Path, where: str, key: str, value: object
) -> None:
    dist = faccel.detect({})
    saved = _state(0)
    if where == "group":
        saved.optimizer.param_groups[0][key] = value
    else:
        setattr(saved.scheduler, key, value)
    faccel.checkpoint(dist, saved, tmp_path)
    target = _state(1)
    before = [p.detach().clone() for p in target.model.parameters()]
    groups_before = [dict(g, params=None) for g in target.optimizer.param_groups]
    with pytest.raises(CheckpointError, match=rf"state\.json.*{key}"):
        faccel.restore(dist, target, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(before, target.model.parameters(), strict=True))
    assert [dict(g, params=None) for g in target.optimizer.param_groups] == groups_before
    target.optimizer.step()  # still trains: nothing was loaded


def test_values_of_the_same_kinds_restore(tmp_path: Path) -> None:
    dist = faccel.detect({})
    saved = _state(0)
    saved.optimizer.param_groups[0]["lr"] = 1  # an int where the target holds a float: a number all the same
    faccel.checkpoint(dist, saved, tmp_path)
    restored = faccel.restore(dist, _state(1), tmp_path)
    assert restored.optimizer.param_groups[0]["lr"] == 1
    restored.optimizer.step()
