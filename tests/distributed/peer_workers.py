"""Functions the two-process tests of hung and missing peers run on every rank.

Each returns what the user would see (the error's type and message, and how long
it took), so a test can assert the named error instead of a hang or an abort.
"""

from __future__ import annotations

import datetime
import time
from typing import Any

import torch

from tests.distributed.workers import Blocks, seed_task


def _outcome(call: Any) -> dict[str, Any]:
    start = time.monotonic()
    try:
        call()
    except Exception as error:  # the test asserts which error, and its message
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - start}
    return {"error": None, "message": "", "seconds": time.monotonic() - start}


def hung_rank(collective: str, timeout_s: float, sleep_s: float) -> dict[str, Any]:
    """One rank sleeps past the timeout while the other waits in ``collective``.

    Rank 1 sleeps instead of joining, except for ``main_process_first``, where
    rank 0 sleeps inside the block (a download slower than the timeout) while
    rank 1 waits to enter it.
    """
    import faccel

    dist = faccel.detect(timeout=datetime.timedelta(seconds=timeout_s))
    calls = {
        "gather": lambda: faccel.gather(dist, torch.ones(2)),
        "reduce": lambda: faccel.reduce(dist, torch.ones(2)),
        "broadcast": lambda: faccel.broadcast(dist, torch.ones(2)),
        "wait_for_everyone": lambda: faccel.wait_for_everyone(dist),
    }
    faccel.wait_for_everyone(dist)  # both ranks are up before the clock starts
    if collective == "main_process_first":

        def in_the_block() -> None:
            with faccel.main_process_first(dist):
                if dist.is_main_process:
                    time.sleep(sleep_s)

        return _outcome(in_the_block)  # rank 0's own exit barrier then finds rank 1 gone
    if dist.rank == 1:
        time.sleep(sleep_s)  # the hung rank: never reaches the collective in time
        return {"error": None, "message": "slept", "seconds": sleep_s}
    return _outcome(calls[collective])


def skipped_collective(root: str, timeout_s: float, sleep_s: float) -> dict[str, Any]:
    """Three steps and a checkpoint on both ranks, one reduce; then rank 1 skips the gather rank 0 calls."""
    import faccel

    dist = faccel.detect(timeout=datetime.timedelta(seconds=timeout_s))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    for _ in range(3):
        faccel.backward(dist, model(torch.ones(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
    faccel.checkpoint(dist, faccel.TrainState.create(model=model, optimizer=optimizer, step=3), root)
    faccel.reduce(dist, torch.ones(2))
    if dist.rank == 1:
        time.sleep(sleep_s)  # skips the gather: never reaches it
        return {"error": None, "message": "skipped", "seconds": sleep_s}
    return _outcome(lambda: faccel.gather(dist, torch.ones(2)))


def hung_after_warm_up(timeout_s: float, train_timeout_s: float, sleep_s: float) -> dict[str, Any]:
    """Two DDP steps (warmed up after the first), then rank 1 hangs while rank 0 reduces."""
    import faccel

    dist = faccel.detect(
        timeout=datetime.timedelta(seconds=timeout_s),
        train_timeout=datetime.timedelta(seconds=train_timeout_s),
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    for _ in range(2):
        faccel.backward(dist, model(torch.ones(2, 4)).sum())
        optimizer.step()
        optimizer.zero_grad()
    if dist.rank == 1:
        time.sleep(sleep_s)
        return {"error": None, "message": "slept", "seconds": sleep_s}
    return _outcome(lambda: faccel.reduce(dist, torch.ones(2)))


def fsdp_eval_on_main_only(timeout_s: float) -> dict[str, Any]:
    """nanoGPT's ``if master_process: estimate_loss()`` under FSDP2, as the user writes it."""
    import faccel

    dist = faccel.detect(strategy="fsdp", timeout=datetime.timedelta(seconds=timeout_s))
    x, y = seed_task(n=16)
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    shard = slice(dist.rank * 8, dist.rank * 8 + 8)

    def train_step() -> None:
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(x[shard]), y[shard]))
        optimizer.step()

    def estimate_loss() -> None:
        model.eval()
        with torch.no_grad():
            for _ in range(3):
                torch.nn.functional.mse_loss(model(x[shard]), y[shard])
        model.train()

    train_step()
    if dist.is_main_process:
        return _outcome(estimate_loss)
    return _outcome(lambda: [train_step() for _ in range(3)])


def fsdp_eval_on_every_rank() -> dict[str, Any]:
    """The right way: every rank evaluates (its own batch), and the losses are reduced."""
    import faccel

    dist = faccel.detect(strategy="fsdp")
    x, y = seed_task(n=16)
    torch.manual_seed(0)
    model = faccel.prepare(dist, Blocks())
    shard = slice(dist.rank * 8, dist.rank * 8 + 8)
    losses = []
    model.eval()
    with torch.no_grad():
        for _ in range(3):
            loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard])
            losses.append(faccel.reduce(dist, loss).item())
    return {"losses": losses}


def peer_gone_before_checkpoint(root: str, timeout_s: float) -> dict[str, Any]:
    """Rank 1 leaves (its process ends) just before a checkpoint; rank 0 calls it."""
    import faccel

    dist = faccel.detect(timeout=datetime.timedelta(seconds=timeout_s))
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    faccel.wait_for_everyone(dist)
    if dist.rank == 1:
        return {"error": None, "message": "left", "seconds": 0.0}
    return _outcome(lambda: faccel.checkpoint(dist, state, root))


def peer_gone_at_the_agreement(timeout_s: float) -> dict[str, Any]:
    """Both ranks check in (the store), then rank 1 leaves before the agreement's all_reduce (26.10)."""
    import faccel
    from faccel._dist._consensus import agree_max, arrive

    dist = faccel.detect(timeout=datetime.timedelta(seconds=timeout_s))
    arrive(
        dist, "agreement", timeout=datetime.timedelta(seconds=timeout_s), raises=faccel.errors.CheckpointError
    )
    if dist.rank == 1:
        return {"error": None, "message": "left", "seconds": 0.0}
    what = "the checkpoint's agreement"
    return _outcome(lambda: agree_max(dist, [1], what=what, raises=faccel.errors.CheckpointError))


def fsdp_eval_uneven(timeout_s: float) -> dict[str, Any]:
    """Every rank evaluates, but rank 0 one batch more (an uneven evaluation loader), then trains."""
    import faccel

    dist = faccel.detect(strategy="fsdp", timeout=datetime.timedelta(seconds=timeout_s))
    x, y = seed_task(n=16)
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    shard = slice(dist.rank * 8, dist.rank * 8 + 8)

    def train_step() -> None:
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(x[shard]), y[shard]))
        optimizer.step()

    def evaluate_then_train() -> None:
        with torch.no_grad():
            for _ in range(3 if dist.rank == 0 else 2):
                model(x[shard])
        train_step()

    train_step()
    return _outcome(evaluate_then_train)


def fsdp_check_ins() -> dict[str, Any]:
    """The collectives each phase of a loop enters, the hooks faccel holds, and what shutdown leaves."""
    import faccel

    dist = faccel.detect(strategy="fsdp")
    x, y = seed_task(n=16)
    torch.manual_seed(0)
    model = Blocks()
    # Prepared before its model, in its own call: the rebind hook waits for the first step.
    optimizer = faccel.prepare(dist, torch.optim.SGD(model.parameters(), lr=0.01))
    model = faccel.prepare(dist, model)
    held = {"after prepare": len(dist.runtime.handles)}
    shard = slice(dist.rank * 8, dist.rank * 8 + 8)
    runtime = dist.runtime

    def train(steps: int) -> int:
        before = runtime.collectives
        for _ in range(steps):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x[shard]), y[shard]).backward()
            optimizer.step()
        return runtime.collectives - before

    def evaluate(batches: int) -> int:
        before = runtime.collectives
        with torch.no_grad():
            for _ in range(batches):
                model(x[shard])
        return runtime.collectives - before

    phases = [train(2), evaluate(3), train(2), evaluate(4), evaluate(1)]
    held["after the first step"] = len(runtime.handles)
    hooks = len(model._forward_pre_hooks)
    faccel.shutdown(dist)
    return {
        "phases": phases,
        "held": held,
        "hooks removed": hooks - len(model._forward_pre_hooks),
        "left": [len(runtime.handles), len(runtime.groups)],
    }
