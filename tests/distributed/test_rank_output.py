"""Logging and progress bars in two real gloo processes: rank 0 speaks, rank 1 only when asked."""

from __future__ import annotations

import io
import logging
from typing import Any

import torch

from tests.distributed import harness


def log_and_draw() -> dict[str, Any]:
    import faccel

    dist = faccel.detect()
    out = io.StringIO()
    logger = logging.getLogger("faccel_test.ranks")
    logger.addHandler(logging.StreamHandler(out))
    logger.setLevel(logging.INFO)
    log = faccel.get_logger(dist, "faccel_test.ranks")
    log.info("main only")
    log.info("every rank", main_process_only=False)
    data = torch.utils.data.TensorDataset(torch.arange(20))
    loader = faccel.prepare(dist, torch.utils.data.DataLoader(data, batch_size=2))
    bar = io.StringIO()
    batches = sum(1 for _ in faccel.progress(dist, loader.at(epoch=0, start=1), file=bar, mininterval=0))
    return {"log": out.getvalue(), "bar": bar.getvalue(), "batches": batches, "len": len(loader)}


def test_only_rank_zero_logs_and_draws_by_default() -> None:
    rank0, rank1 = harness.run(log_and_draw, world_size=2)
    assert rank0["log"] == "[rank 0/2] main only\n[rank 0/2] every rank\n"
    assert rank1["log"] == "[rank 1/2] every rank\n"
    assert rank0["len"] == rank1["len"] == 5
    assert rank0["batches"] == rank1["batches"] == 4
    assert "5/5" in rank0["bar"]
    assert rank1["bar"] == ""
