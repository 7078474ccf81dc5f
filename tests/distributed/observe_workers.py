"""Functions the two-process tests of the meter run on every rank: a slow rank, a stopped rank.

Each returns plain data (what the loop saw, or the error a rank got), never tensors.
"""

from __future__ import annotations

import datetime
import socket
import time
from pathlib import Path
from typing import Any

import torch


def _parts(dist: Any) -> tuple[Any, Any]:
    import faccel

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return faccel.prepare(dist, model, optimizer)


def _step(dist: Any, model: Any, optimizer: Any, *, sleep: float = 0.0) -> None:
    import faccel

    inputs = torch.randn(32, 64)
    if sleep:
        time.sleep(sleep)  # the straggler's slow data or forward, before the gradient sync
    faccel.backward(dist, model(inputs).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def slow_rank(root: str, every: int) -> dict[str, Any]:
    """DDP steps with a meter; after a first check, rank 1 sleeps in each step: the next check names it.

    The sleep is ten times the slowest rank's forward time at the first check (measured here, now),
    and the factor three: the sleeper stands out whatever the machine's speed.
    """
    import faccel

    dist = faccel.detect()
    model, optimizer = _parts(dist)
    tracker = faccel.init_tracker(dist, root)
    meter, spreads = faccel.start_meter(dist), []
    sleep = 0.0
    for step in range(2 * every):
        _step(dist, model, optimizer, sleep=sleep if dist.rank == 1 else 0.0)
        meter = faccel.measure(dist, meter, items=32)
        spread, meter = faccel.check_stragglers(dist, meter, every=every, factor=3.0)
        faccel.log(dist, tracker, step, meter.metrics())
        if spread is not None:
            spreads.append(spread)
            faccel.log(dist, tracker, step, spread.metrics())
            sleep = 10 * max(spread.seconds)
    faccel.end_training(dist, tracker)
    last = spreads[-1]
    return {
        "named": [[s.rank, s.host, s.local_rank] for s in last.stragglers],
        "seconds": list(last.seconds),
        "sleep": sleep,
        "host": socket.gethostname(),
        "steps": meter.step,
        "items_per_second": meter.run_items_per_second,
        "memory": meter.memory_bytes,
    }


def stopped_rank(root: str) -> dict[str, Any]:
    """Two metered steps; in the third, rank 1 stops after its backward, before the straggler check.

    Rank 1 waits until its hang record says ``backward``, tells rank 0, and blocks until rank 0 has
    its error: no sleep races the timeout. The set-up and the first checks wait as long as faccel's
    default; rank 0 then shortens its timeout to twenty times its slowest step so far, measured here
    (what ``train_timeout`` does once training has warmed up), so the test lasts as long as this
    machine needs and no fixed wait is raced.
    """
    import faccel
    from faccel._dist._hangs import HANGS_FOLDER, read_record
    from faccel._torch_compat import default_store

    dist = faccel.detect()
    model, optimizer = _parts(dist)
    tracker = faccel.init_tracker(dist, root)
    meter, slowest = faccel.start_meter(dist), 0.0
    for _ in range(2):
        _step(dist, model, optimizer)
        meter = faccel.measure(dist, meter, items=32)
        _, meter = faccel.check_stragglers(dist, meter, every=1)
        slowest = max(slowest, meter.step_seconds)
    faccel.backward(dist, model(torch.randn(32, 64)).square().mean())
    store, records = default_store(), Path(root) / HANGS_FOLDER
    if dist.rank == 1:
        while (record := read_record(records, 1)) is None or record.phase != "backward":
            time.sleep(0.01)
        store.set("observe/stopped", "1")
        store.wait(["observe/done"], datetime.timedelta(seconds=120))
        faccel.end_training(dist, tracker)
        return {"error": None, "message": "stopped"}
    store.wait(["observe/stopped"], datetime.timedelta(seconds=120))
    timeout = datetime.timedelta(seconds=20 * slowest)
    dist.runtime.warm_up(timeout)
    meter = faccel.measure(dist, meter, items=32)
    started = time.perf_counter()
    try:
        faccel.check_stragglers(dist, meter, every=1)
        outcome: dict[str, Any] = {"error": None, "message": ""}
    except Exception as error:  # the test asserts which error, and its message
        outcome = {"error": type(error).__name__, "message": str(error)}
    outcome["waited"] = time.perf_counter() - started
    outcome["timeout"] = timeout.total_seconds()
    own = read_record(records, 0)
    outcome["own_state"] = own.state if own else None
    outcome["host"] = socket.gethostname()
    store.set("observe/done", "1")
    faccel.end_training(dist, tracker)
    return outcome
