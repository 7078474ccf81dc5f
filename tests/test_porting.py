"""What a port from Accelerate needs to keep its meaning."""

from __future__ import annotations

import pytest
import torch

import faccel


def _lrs(dist: faccel.DistState, steps: int, scheduler_steps: int, kind: str) -> list[float]:
    w = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([w], lr=1.0)
    if kind == "warmup":  # transformers' get_linear_schedule_with_warmup(warmup 4, total 12)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda n: n / 4 if n < 4 else max(0.0, (12 - n) / 8)
        )
    else:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=12)
    lrs = []
    for _ in range(steps):
        faccel.backward(dist, w.sum())
        faccel.optimizer_step(dist, optimizer, scheduler=scheduler, scheduler_steps=scheduler_steps)
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def _accelerate_rule(steps: int, processes: int, kind: str) -> list[float]:
    """Accelerate's AcceleratedScheduler.step, written out: num_processes steps, OneCycle stops at its end."""
    w = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([w], lr=1.0)
    if kind == "warmup":
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda n: n / 4 if n < 4 else max(0.0, (12 - n) / 8)
        )
    else:
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=12)
    lrs = []
    for _ in range(steps):
        optimizer.step()
        for _ in range(processes):
            if hasattr(scheduler, "total_steps"):
                if scheduler._step_count <= scheduler.total_steps:
                    scheduler.step()
            else:
                scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


@pytest.mark.parametrize("kind", ["warmup", "onecycle"])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_accelerate_scheduler_steps_replays_an_accelerate_schedule(kind: str, world_size: int) -> None:
    dist = faccel.DistState.simulated(rank=0, world_size=world_size)
    n = faccel.accelerate_scheduler_steps(dist)
    assert n == world_size and faccel.accelerate_scheduler_steps(dist, split_batches=True) == 1
    # On several processes OneCycle reaches its end and stops there, as in Accelerate.
    steps = 12 // world_size + (world_size > 1)
    assert _lrs(faccel.detect({}), steps, n, kind) == _accelerate_rule(steps, world_size, kind)


def test_faccel_steps_once_and_the_warmup_lasts_world_size_times_longer() -> None:
    once = _lrs(faccel.detect({}), 4, 1, "warmup")
    twice = _lrs(faccel.detect({}), 2, 2, "warmup")
    assert once[-1] == twice[-1] == 1.0  # the warmup's end: 4 optimizer steps here, 2 there


@pytest.mark.parametrize("bad", [0, -1])
def test_scheduler_steps_below_one_is_refused(bad: int) -> None:
    with pytest.raises(faccel.errors.ArgumentValueError, match="scheduler_steps"):
        _lrs(faccel.detect({}), 1, bad, "warmup")


def test_local_main_process_first_runs_the_block_in_one_process() -> None:
    ran = []
    with faccel.local_main_process_first(faccel.detect({})):
        ran.append(1)
    assert ran == [1]


_ACCELERATE_TWIN = """
import json, torch
from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
w = torch.nn.Parameter(torch.ones(1))
optimizer = torch.optim.SGD([w], lr=1.0)
scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1.0, total_steps=12)
optimizer, scheduler = accelerator.prepare(optimizer, scheduler)
lrs = []
for _ in range(6):
    w.grad = torch.ones(1)
    optimizer.step()
    scheduler.step()
    lrs.append(scheduler.get_last_lr()[0])
print(json.dumps(lrs))
"""


def test_accelerate_scheduler_matches_where_accelerate_is_installed() -> None:
    """Accelerate's prepared scheduler on one process (its own process: Accelerate keeps singletons)."""
    pytest.importorskip("accelerate")
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _ACCELERATE_TWIN], capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(done.stdout.strip().splitlines()[-1]) == _lrs(faccel.detect({}), 6, 1, "onecycle")


def test_the_guides_conversion_reproduces_accelerates_schedule_on_2_processes() -> None:
    """docs/from-accelerate.md, first section, point 1: Accelerate on 2 gloo processes steps
    ``get_linear_schedule_with_warmup(8, 24)`` twice per optimizer step; the port's
    ``(8 / 2, 24 / 2)`` stepped once by faccel gives the same learning rates, bit for bit."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="the twin runs Accelerate (not in the test extra)")
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*launch, "tests/by_feature_accelerate.py", "warmup_schedule"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    assert theirs["processes"] == 2
    dist = faccel.detect({})
    n = 2  # Accelerate's num_processes in the script being ported
    w = torch.nn.Parameter(torch.ones(1))
    optimizer = torch.optim.SGD([w], lr=1.0)
    scheduler = transformers.get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=8 // n, num_training_steps=24 // n
    )
    lrs = []
    for _ in range(12):
        faccel.backward(dist, w.sum())
        faccel.optimizer_step(dist, optimizer, scheduler=scheduler)
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    assert lrs == theirs["lrs"] and lrs[3] == 1.0 and lrs[-1] == 0.0  # warmup ends at step 4
