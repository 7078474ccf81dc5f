"""The strategy-state table: each model gets its strategy's state, and a rank that owns only some
names (a pipeline stage) restores them, from either format, as an ordinary target.

The stage strategy here is a test row put in front of the table (what engineer ``pipeline``'s
module will be): it holds a module marked with the names it keeps, and owns exactly those.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import pytest
import torch


def _model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        OrderedDict(embed=torch.nn.Linear(3, 4), block=torch.nn.Linear(4, 4), head=torch.nn.Linear(4, 2))
    )


def _stage_row() -> object:
    from faccel._checkpoint._strategies import Ownership
    from faccel._checkpoint._strategies._plain import PlainState

    class StageState(PlainState):
        name = "stage"

        def holds(self, model: object) -> bool:
            return hasattr(model, "stage_names")

        def ownership(self, model: object) -> Ownership:
            return Ownership(names=frozenset(model.stage_names))  # type: ignore[attr-defined]

    return StageState()


def test_strategy_of_names_each_prepared_kind() -> None:
    import faccel
    from faccel._checkpoint._strategies import strategy_of

    model = torch.nn.Linear(2, 1)
    assert strategy_of(model).name == "plain"
    assert strategy_of(model).ownership(model).every_name
    prepared = faccel.prepare(faccel.detect({}), torch.nn.Linear(2, 1))
    assert strategy_of(prepared).export_kind(prepared) == "main"


@pytest.mark.parametrize("sharded", [False, True], ids=["whole-tensor", "sharded"])
def test_a_rank_that_owns_some_names_restores_them_and_refuses_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sharded: bool
) -> None:
    import faccel
    from faccel._checkpoint import _strategies
    from faccel._checkpoint._strategies._plain import PlainState

    dist = faccel.detect({})
    full = _model()
    faccel.checkpoint(dist, faccel.TrainState.create(model=full, optimizer=None), tmp_path, sharded=sharded)
    stage = _model()
    for module in stage.modules():
        if isinstance(module, torch.nn.Linear):
            torch.nn.init.zeros_(module.weight)
    del stage.embed  # a pipeline stage keeps the full model's names for the layers it holds
    stage.stage_names = list(stage.state_dict())  # type: ignore[assignment]
    target = faccel.TrainState.create(model=stage, optimizer=None)
    # Without the stage row every rank is assumed to hold every name: the other stage's are "unexpected".
    with pytest.raises(faccel.errors.CheckpointError, match=r"unexpected 'embed\.weight'"):
        faccel.restore(dist, target, tmp_path)
    monkeypatch.setattr(_strategies, "STRATEGY_STATES", (_stage_row(), PlainState()))
    restored = faccel.restore(dist, target, tmp_path)
    assert restored.step == 0
    for name, tensor in stage.state_dict().items():
        assert torch.equal(tensor, full.state_dict()[name]), name
    # A name the stage owns but the checkpoint lacks is still missing.
    stage.stage_names = [*stage.stage_names, "tail.weight"]  # type: ignore[assignment]
    stage.register_buffer("tail", torch.zeros(1))
    stage.stage_names = [*stage.stage_names, "tail"]  # type: ignore[assignment]
    with pytest.raises(faccel.errors.CheckpointError, match="tail"):
        faccel.restore(dist, target, tmp_path)
