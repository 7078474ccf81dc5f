"""faccel.launch: real processes from a running interpreter, rank 0's result, the first failure at once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch


def test_functions_defined_here_run_on_real_ranks_and_rank_0s_result_comes_back() -> None:
    import faccel

    offset = 10  # a closure: forked children have it, as a notebook cell's function

    def work(scale: float) -> tuple[int, float]:
        dist = faccel.detect()
        total = faccel.reduce(dist, torch.tensor([float(dist.rank + offset)]), op="sum")
        return dist.world_size, scale * total.item()

    assert faccel.launch(work, nprocs=3, args=(2.0,)) == (3, 2.0 * (10 + 11 + 12))


def test_a_failing_rank_stops_the_others_at_once_with_its_traceback(tmp_path: Path) -> None:
    import faccel

    def work(folder: str) -> None:
        dist = faccel.detect()
        if dist.rank == 1:
            raise ValueError("bad batch on rank 1")
        (Path(folder) / "pid").write_text(str(os.getpid()))
        time.sleep(600)  # the others would wait long: the launcher must not
        (Path(folder) / "woke").touch()

    with pytest.raises(
        faccel.errors.DistributedError, match=r"rank 1 failed(.|\n)*ValueError: bad batch on rank 1"
    ):
        faccel.launch(work, nprocs=2, args=(str(tmp_path),))
    # No clock: the launcher returned before rank 0's sleep ended, and rank 0 is gone, not orphaned.
    assert not (tmp_path / "woke").exists()
    if (tmp_path / "pid").exists():  # rank 0 may have been stopped before it got there
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / "pid").read_text()), 0)


def test_a_rank_that_dies_and_a_timeout_are_named() -> None:
    import os

    import faccel

    def dies() -> None:
        if faccel.detect(start=False).rank == 1:
            os._exit(3)
        time.sleep(60)

    with pytest.raises(
        faccel.errors.DistributedError, match=r"rank 1 died without an answer \(exit code 3\)"
    ):
        faccel.launch(dies, nprocs=2)
    with pytest.raises(faccel.errors.DistributedError, match=r"ranks \[0\] still running after 0.5 s"):
        faccel.launch(time.sleep, nprocs=1, args=(30,), timeout=0.5)
    with pytest.raises(faccel.errors.ArgumentValueError, match="nprocs must be >= 1"):
        faccel.launch(print, nprocs=0)


def test_any_rank_tells_every_rank_at_the_same_step() -> None:
    # Accelerate's set_trigger/check_trigger, run through faccel.launch like a notebook would.
    import faccel

    def loop() -> list[int]:
        dist = faccel.detect()
        stopped_at = []
        for step in range(5):
            loss = torch.tensor(float("nan") if (dist.rank == 1 and step == 3) else 1.0)
            if faccel.any_rank(dist, torch.isnan(loss)):
                stopped_at.append(step)
                break
        # every rank reports where it stopped; rank 0 returns them all
        return [int(x) for x in faccel.gather(dist, torch.tensor(stopped_at or [-1])).tolist()]

    assert faccel.launch(loop, nprocs=3) == [3, 3, 3]
    assert faccel.any_rank(faccel.detect({}), False) is False


def test_a_launched_function_may_start_dataloader_workers() -> None:
    import faccel

    def work() -> list[float]:
        dist = faccel.detect()
        loader = torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.arange(8.0)), batch_size=2, num_workers=1
        )
        loader = faccel.prepare(dist, loader)
        return sorted(float(x) for (batch,) in loader for x in batch)

    # Daemonic children may not have children of their own: the loader's workers need them.
    seen = faccel.launch(work, nprocs=2)
    assert len(seen) == 4 and set(seen) <= set(range(8))  # rank 0's half of the samples
