"""Fault-tolerant replicas: the quorum's cost per step, and a kill's cost, healed vs restarted.

Two measures (docs/fault-tolerance.md):

* **The step when nothing fails.** Three gloo processes train the small MLP on their own
  batches: blocks of faccel's DDP step (``prepare``, ``backward``) alternate with blocks of
  the fault-tolerant step (``replica_quorum``, forward and backward, ``replica_commit``:
  torchft's quorum, the gradients gathered and combined in rank order, the commit vote),
  with a quorum at every step (the default) and with ``quorum_every=16``, the order
  rotating. Each has its own lighthouse. The ratios are each over the DDP step.
* **A kill.** From the SIGKILL of one of three replicas to the restarted replica's first
  committed step after healing from a live peer (the survivors never stop), against the
  same kill in a DDP job: every rank restarted (as torchrun's agent does), each restoring
  the latest checkpoint, until all three have taken their first step again. Both include
  starting the processes (from a preloaded fork server).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import FACCEL, Row, interleave, per_call, rank_env, rows, run_ranks

DDP = "faccel DDP"
SIZES = (32, 64, 64, 1)
EVERY = 16  # the quorum_every of the second fault-tolerant subject
FT = "faccel, a quorum every step"
FT_EVERY = f"faccel, a quorum every {EVERY} steps"
BATCH = 32
WORLD = 3
# Samples in an epoch of the fault-tolerant loop: 1000 steps of the full quorum, so that a run
# crosses a few epochs (each draws the epoch's order once, as a sampler does).
EPOCH = 1000 * WORLD * BATCH


def _quiet_servers() -> None:
    # torchft's servers log every quorum and commit at INFO: megabytes a minute to stderr, which
    # the fault-tolerant step would pay for and the DDP step not. Warnings only, as a job would
    # run it: set before torchft's first import, which reads it (run.py imports it in
    # unavailable(), before run()); the ranks inherit it.
    os.environ.setdefault("RUST_LOG", "warn")


def unavailable() -> str | None:
    _quiet_servers()
    try:
        import torchft  # noqa: F401
    except ImportError:
        return "torchft is not installed (pip install 'faccel[ft]')"
    return None


def replica(rank: int, every: int, lighthouse: str) -> tuple[Any, Any, Any, Any]:
    """One fault-tolerant replica of the small MLP: its own DistState, handle, model and state."""
    import faccel
    from benchmarks.bench_step import _parts

    model, optimizer, scheduler = _parts(SIZES)
    state = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)
    dist = faccel.DistState(seed=0)
    ft = faccel.fault_tolerant(
        dist,
        state,
        replica=rank,
        lighthouse=lighthouse,
        dataset_size=EPOCH,
        batch_size=BATCH,
        host="127.0.0.1",
        quorum_every=every,
    )
    return dist, ft, model, state


def _step_worker(rank: int, port: int, plan: tuple[int, int, tuple[str, str]], out: str) -> None:
    os.environ.update(rank_env(rank, port, WORLD))
    import torch
    import torch.distributed as tdist

    import faccel
    from benchmarks.bench_step import _parts, batches

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    rounds, steps, lighthouses = plan
    dist = faccel.detect()
    pool = batches(SIZES, BATCH, classes=False, seed=1 + rank)
    loss_fn = torch.nn.functional.mse_loss

    model, optimizer, scheduler = faccel.prepare(dist, *_parts(SIZES))
    data = itertools.cycle(pool)

    def ddp_step() -> None:
        inputs, targets = next(data)
        optimizer.zero_grad()
        faccel.backward(dist, loss_fn(model(inputs), targets))
        optimizer.step()
        scheduler.step()

    handles = []

    def ft_subject(every: int, lighthouse: str):  # type: ignore[no-untyped-def]
        ft_dist, ft, ft_model, state = replica(rank, every, lighthouse)
        handles.append(ft_dist)
        held = {"state": state}

        def ft_step() -> None:
            inputs, targets = next(data)
            quorum = faccel.replica_quorum(ft, held["state"])
            loss_fn(ft_model(inputs), targets).backward()
            held["state"] = faccel.replica_commit(ft, quorum)

        return ft_step

    def block(step):  # type: ignore[no-untyped-def]
        def timed() -> float:
            tdist.barrier()  # all ranks start the block together
            return per_call(step, steps, now=time.perf_counter)

        return timed

    subjects = {
        DDP: block(ddp_step),
        FT: block(ft_subject(1, lighthouses[0])),
        FT_EVERY: block(ft_subject(EVERY, lighthouses[1])),
    }
    samples = interleave(subjects, rounds=rounds)
    if rank == 0:
        Path(out).write_text(json.dumps(samples))
    for ft_dist in handles:
        faccel.shutdown(ft_dist)
    faccel.shutdown(dist)


def _step_rows(quick: bool) -> list[Row]:
    from torchft._torchft import LighthouseServer

    plan = (8, 32) if quick else (30, 96)  # steps a block: a multiple of EVERY
    lighthouses = [LighthouseServer(bind="127.0.0.1:0", min_replicas=WORLD) for _ in range(2)]
    try:
        addresses = tuple("http://127.0.0.1:" + lh.address().rsplit(":", 1)[1] for lh in lighthouses)
        samples = run_ranks(
            _step_worker, (*plan, addresses), what="fault-tolerance benchmark", world_size=WORLD
        )
    finally:
        for lighthouse in lighthouses:
            lighthouse.shutdown()
    setting = (
        f"small MLP {'-'.join(map(str, SIZES))}, batch {BATCH} per replica, {WORLD} gloo processes "
        f"({plan[1]} steps a block)"
    )
    # One row pair per cadence, each against the same DDP blocks: the target applies to both.
    return [
        row
        for subject, cadence in ((FT, "a quorum every step"), (FT_EVERY, f"quorum_every={EVERY}"))
        for row in rows(
            f"{setting}, {cadence}",
            {DDP: samples[DDP], FACCEL: samples[subject]},
            baseline=DDP,
            unit="us/step",
            scale=1e6,
            goals="ft_step",
        )
    ]


def _heal_seconds(kills: int) -> list[float]:
    from tests.distributed.ft_workers import kill_run, records

    with tempfile.TemporaryDirectory() as out:
        run = kill_run(kills=kills, seed=5, out=out, timeout=60.0 * kills + 120)
        lines = records(out, WORLD)
    figures = []
    for kill in run["kills"]:
        mine = lines[kill["replica"]]
        later = [line["time"] for line in mine if "step" in line and line["time"] > kill["time"]]
        if later:
            figures.append(min(later) - kill["time"])
    return figures


def _ddp_worker(*, rank: int, port: int, root: str, out: str, restore: bool) -> None:
    os.environ.update(rank_env(rank, port, WORLD))
    import torch

    import faccel
    from benchmarks.bench_step import _parts, batches

    torch.set_num_threads(1)
    dist = faccel.detect()
    model, optimizer, scheduler = faccel.prepare(dist, *_parts(SIZES))
    state = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)
    if restore:
        state = faccel.restore(dist, state, root)
    pool = itertools.cycle(batches(SIZES, BATCH, classes=False, seed=1 + rank))
    while True:
        inputs, targets = next(pool)
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        scheduler.step()
        state = faccel.TrainState.create(
            model=model, optimizer=optimizer, scheduler=scheduler, step=state.step + 1
        )
        if not restore and state.step == 5:
            faccel.checkpoint(dist, state, root)
        Path(out, f"step-{rank}").write_text(str(time.time()))


def _restart_seconds(kills: int) -> list[float]:
    import multiprocessing as mp
    from datetime import timedelta

    import torch.distributed as tdist

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "faccel", "benchmarks.bench_step"])
    figures = []
    for _ in range(kills):
        with tempfile.TemporaryDirectory() as root, tempfile.TemporaryDirectory() as out:

            def start(restore: bool) -> tuple[object, list[mp.process.BaseProcess]]:
                store = tdist.TCPStore(
                    "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
                )
                procs = [
                    ctx.Process(
                        target=functools.partial(
                            _ddp_worker, rank=r, port=store.port, root=root, out=out, restore=restore
                        )
                    )
                    for r in range(WORLD)
                ]
                for proc in procs:
                    proc.start()
                return store, procs

            store, procs = start(False)
            while not list(Path(root).glob("step-*")) or len(list(Path(out).glob("step-*"))) < WORLD:
                time.sleep(0.01)
            killed_at = time.time()
            procs[2].kill()
            # torchrun's agent ends the other ranks of the failed group and starts all again.
            for proc in procs:
                proc.kill()
                proc.join()
            for file in Path(out).glob("step-*"):
                file.unlink()
            store2, procs = start(True)
            while len(list(Path(out).glob("step-*"))) < WORLD:
                time.sleep(0.01)
            stepped = max(float(file.read_text() or "inf") for file in Path(out).glob("step-*"))
            figures.append(stepped - killed_at)
            for proc in procs:
                proc.kill()
                proc.join()
            del store, store2
    return figures


def run(quick: bool) -> list[Row]:
    _quiet_servers()
    result = _step_rows(quick)
    kills = 2 if quick else 5
    heal = _heal_seconds(kills)
    restart = _restart_seconds(kills)
    case = f"a SIGKILL of one of {WORLD} replicas to its first step again (processes from a fork server)"
    result.append(
        Row(
            case=case,
            subject="restart from a checkpoint (all ranks)",
            value=statistics.median(restart),
            unit="s",
            rounds=len(restart),
            note=f"{min(restart):.2f}-{max(restart):.2f} s",
        )
    )
    result.append(
        Row(
            case=case,
            subject="heal from a live peer (survivors go on)",
            value=statistics.median(heal),
            unit="s",
            baseline="restart from a checkpoint (all ranks)",
            median=statistics.median(heal) / statistics.median(restart),
            rounds=len(heal),
            note=f"{min(heal):.2f}-{max(heal):.2f} s",
        )
    )
    return result
