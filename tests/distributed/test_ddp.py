"""Real two-process gloo runs of the seed loop (see harness.py for the cost model)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from tests.distributed import harness, workers

ROOT = Path(__file__).resolve().parents[2]


def _single_process_full_batch(per_rank_batch: int, world: int, epochs: int) -> list[torch.Tensor]:
    """What DDP over `world` ranks should compute: one process on the concatenated batches."""
    import faccel

    x, y = workers.seed_task()
    model = workers.seed_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    shards = [
        faccel.Sharding(num_samples=len(x), batch_size=per_rank_batch, rank=r, world_size=world)
        for r in range(world)
    ]
    for epoch in range(epochs):
        per_rank = [s.batches(epoch) for s in shards]
        for step in range(shards[0].num_batches):
            optimizer.zero_grad()
            # DDP averages the ranks' mean losses' gradients: the mean over ranks of each mean.
            loss = sum(torch.nn.functional.mse_loss(model(x[b[step]]), y[b[step]]) for b in per_rank) / world
            loss.backward()
            optimizer.step()
            scheduler.step()
    return [p.detach().flatten() for p in model.parameters()]


def test_two_gloo_processes_train_like_one_process_on_the_full_batch() -> None:
    results = harness.run(workers.seed_loop, world_size=2, steps_per_epoch_batch=8, epochs=2)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["wrapped"] == "DistributedDataParallel" for r in results)
    # 64 samples / (2 ranks x 8) = 4 steps an epoch, and the scheduler advanced once per step
    assert all(r["steps"] == 8 and r["last_epoch"] == 8 for r in results)
    assert results[0]["params"] == results[1]["params"]  # bitwise equal across ranks
    expected = _single_process_full_batch(per_rank_batch=8, world=2, epochs=2)
    for got, want in zip(results[0]["params"], expected, strict=True):
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-6)


def test_main_process_first_orders_the_ranks(tmp_path: Path) -> None:
    path = tmp_path / "order.txt"
    harness.run(workers.barrier_order, world_size=2, path=str(path))
    assert path.read_text() == "01"


def test_torchrun_runs_the_example_as_two_processes() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "seed_loop.py"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "world size 2" in done.stdout
    assert "8 batches per rank per epoch" in done.stdout


def test_a_module_prepared_twice_gets_its_first_wrapper_not_a_second_ddp() -> None:
    for result in harness.run(workers.prepare_twice, world_size=2):
        assert result["same_wrapper"] and result["copy_wrapped_apart"]
        assert "prepared under another DistState" in result["refused"]


def test_a_schedule_sized_after_prepare_ends_annealed_on_two_processes() -> None:
    # Sized from len() of the DataLoader before prepare (14 batches an epoch, both ranks' together),
    # a OneCycleLR ended half-annealed; the documented way sizes it from the prepared loader.
    results = harness.run(workers.schedule_sized_after_prepare, world_size=2, epochs=3, accumulation_steps=2)
    floor = 0.05 / 25 / 1e4  # OneCycleLR's last LR: max_lr / div_factor / final_div_factor
    for r in results:
        assert (r["raw_len"], r["len"], r["total"], r["steps"]) == (14, 7, 12, 12)  # 7 batches: 4 steps
        assert abs(r["last_lr"] - floor) < 1e-12  # the last optimizer step ran at the annealed LR
        assert "needs the loader that faccel.prepare returned, got DataLoader" in r["refused"]
