"""What the two-rank tests of named checkpoints, older checkpoints and rollback run on every rank."""

from __future__ import annotations

import os

import attrs
import torch

import faccel


def _state(dist: faccel.DistState, seed: int) -> faccel.TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    model = faccel.prepare(dist, model)
    return faccel.TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def _digest(state: faccel.TrainState) -> list[float]:
    return [float(v) for v in faccel.unwrap_model(state.model).weight.detach().flatten()]


def history(root: str) -> dict:
    """Numbered and named checkpoints, an older one into a new root, a rollback, a refusal."""
    dist = faccel.detect()
    state = _state(dist, 0)
    run, new = os.path.join(root, "run"), os.path.join(root, "new")
    weights = {}
    for step in (1, 2, 3):
        with torch.no_grad():
            faccel.unwrap_model(state.model).weight.add_(1.0)
        faccel.checkpoint(dist, attrs.evolve(state, step=step), run)
        weights[step] = _digest(state)
        if step == 1:
            faccel.checkpoint(dist, attrs.evolve(state, step=step), run, name="epoch_0")
    refused = ""
    try:
        faccel.restore(dist, _state(dist, 1), os.path.join(run, "step-000000000001"))
    except faccel.errors.CheckpointError as error:
        refused = str(error)
    target = _state(dist, 1)
    named = faccel.restore(dist, target, os.path.join(run, "epoch_0"), into=new)
    named_ok = _digest(target) == weights[1]
    faccel.checkpoint(dist, attrs.evolve(named, step=2), new)
    target = _state(dist, 2)
    before = _digest(target)
    # A rollback= that differs per rank: refused on every rank, nothing moved, deleted or loaded.
    mixed = ""
    try:
        choice = "move" if dist.rank == 0 else "delete"
        faccel.restore(dist, target, os.path.join(run, "step-000000000002"), rollback=choice)
    except faccel.errors.CheckpointError as error:
        mixed = str(error)
    mixed_untouched = _digest(target) == before and "step-000000000003" in os.listdir(run)
    rolled = faccel.restore(dist, target, os.path.join(run, "step-000000000002"), rollback="move")
    rolled_ok = _digest(target) == weights[2]
    faccel.checkpoint(dist, attrs.evolve(rolled, step=3), run)  # the root's future is this run's again
    faccel.wait_for_everyone(dist)
    return {
        "rank": dist.rank,
        "refused": refused,
        "mixed": [mixed, mixed_untouched],
        "named": [named.step, named_ok],
        "rolled": [rolled.step, rolled_ok],
        "run": sorted(os.listdir(run)),
        "aside": sorted(os.listdir(os.path.join(run, "abandoned-after-step-000000000002"))),
        "new": sorted(os.listdir(new)),
    }
