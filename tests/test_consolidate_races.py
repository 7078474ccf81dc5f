"""``consolidate`` reads one save, never a mix, whatever replaces the checkpoint (issue 26, item 1)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import faccel
from faccel._consolidate import _specs_and_reader
from faccel.errors import CheckpointError


def _state(fill: float) -> faccel.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(fill)
    return faccel.TrainState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), step=5)


@pytest.mark.parametrize("sharded", [False, True], ids=["v1", "v2-sharded"])
def test_a_replace_between_the_check_and_the_reads_does_not_mix_in(tmp_path: Path, sharded: bool) -> None:
    dist = faccel.detect({})
    folder = faccel.checkpoint(dist, _state(1.0), tmp_path, sharded=sharded)
    specs, read, close = _specs_and_reader(folder)  # checked: the save of 1.0s
    try:
        # a replace=True save of the same step, renamed into place while consolidate reads
        assert faccel.checkpoint(dist, _state(2.0), tmp_path, keep=1, replace=True, sharded=sharded) == folder
        try:
            values = {float(read(name).unique().item()) for name in specs}
        except CheckpointError as error:  # the sharded reader meets the new save's rank page: refused
            assert sharded and "checksum differs" in str(error), error
            return
    finally:
        close()
    assert values == {1.0}, values  # before: the v1 path reopened the file by path and read the 2.0s


def test_a_version_1_checkpoint_consolidates_to_its_weights(tmp_path: Path) -> None:
    from faccel._consolidate import consolidate

    dist = faccel.detect({})
    folder = faccel.checkpoint(dist, _state(3.0), tmp_path / "ckpt", sharded=False)
    consolidate(folder, tmp_path / "hf")
    target = _state(0.0).model
    faccel.load_model(dist, target, tmp_path / "hf")
    assert all(bool((p == 3.0).all()) for p in target.parameters())
