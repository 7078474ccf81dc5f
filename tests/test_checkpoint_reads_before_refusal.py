"""A restore into a model that does not fit reads no tensor before it raises."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import faccel
from faccel.errors import CheckpointError


def _read_bytes() -> int:
    """Bytes this process has read by system calls so far (``rchar``: page-cache hits included)."""
    with open("/proc/self/io") as io:
        return int(next(line for line in io if line.startswith("rchar:")).split()[1])


def _state(rows: int) -> faccel.TrainState:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, rows))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 256)).sum().backward()
    optimizer.step()
    return faccel.TrainState.create(model=model, optimizer=optimizer)


def test_a_model_one_row_short_is_refused_before_any_tensor_is_read(tmp_path: Path) -> None:
    dist = faccel.detect({})
    faccel.checkpoint(dist, _state(512), tmp_path, sharded=True)
    saved_tensor_bytes = 3 * 4 * (256 * 512 + 512 * 512)  # weights and Adam's two moments: 2.4 MB
    target = _state(511)
    before = _read_bytes()
    with pytest.raises(CheckpointError, match="does not fit"):
        faccel.restore(dist, target, tmp_path)
    read = _read_bytes() - before
    # the manifest, state.json and the rank page, never the tensors (before: about 2 MB)
    assert read < saved_tensor_bytes // 10, read
