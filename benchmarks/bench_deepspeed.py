"""Two-process DeepSpeed ZeRO-2 over gloo: a training step through faccel vs DeepSpeed by hand.

Two processes are spawned (``DS_ACCELERATOR=cpu``); each starts gloo through
``faccel.detect(strategy="deepspeed")`` and builds two engines of the same small MLP on
that process group: one with ``deepspeed.initialize`` and the loop DeepSpeed's docs show
(``loss = loss_fn(engine(x), y)``, ``engine.backward(loss)``, ``engine.step()``, the torch
scheduler passed to ``initialize``), one through ``faccel.prepare`` and the seed loop
(``optimizer.zero_grad()``, ``faccel.backward(dist, loss)``, ``optimizer.step()``,
``scheduler.step()``). Blocks of steps alternate between the two (order rotating), rank 0
times them.

The same comparison on 1 process, timed on the process's CPU clock: what faccel adds to
each step without the peer's (and the shared machine's) noise.

Then the checkpoint of each engine: ``faccel.checkpoint`` (ZeRO's state gathered whole,
safetensors + JSON, fsynced, committed by one rename) against DeepSpeed's own
``engine.save_checkpoint`` (each rank ``torch.save``-s its partitions: pickle, no fsync).
Only this benchmark calls ``save_checkpoint``; faccel never does.

Skipped (no rows) when deepspeed is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import FACCEL, Row, interleave, per_call, rank_env, rows, run_ranks

RAW = "raw DeepSpeed"
SIZES = (32, 64, 64, 1)
BATCH = 32
CHECKPOINT_SIZES = (256, 1024, 1024, 1)  # 1.3M parameters: the checkpoint's own cost shows


def _config(world: int) -> dict[str, object]:
    # What faccel fills, written out for the raw engine (DeepSpeed's docs: a complete config).
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": BATCH * world,
        "zero_optimization": {"stage": 2},
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def _worker(rank: int, port: int, plan: tuple[int, int, int, int], out: str) -> None:
    rounds, steps, saves, world = plan
    os.environ.update(rank_env(rank, port, world_size=world))
    os.environ["DS_ACCELERATOR"] = "cpu"
    import itertools

    import deepspeed
    import torch
    import torch.distributed as tdist

    import faccel
    from benchmarks.bench_step import _parts, batches, mlp

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    zero2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": BATCH}
    dist = faccel.detect(strategy="deepspeed", deepspeed=zero2)
    pool = batches(SIZES, BATCH, classes=False, seed=1 + rank)
    loss_fn = torch.nn.functional.mse_loss

    def adamw(sizes: tuple[int, ...]):  # type: ignore[no-untyped-def]
        model = mlp(sizes)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    def raw_engine(sizes: tuple[int, ...], adam: bool = False):  # type: ignore[no-untyped-def]
        model, optimizer, scheduler = _parts(sizes)
        if adam:
            model, optimizer = adamw(sizes)
            scheduler = None
        engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=_config(world),
            dist_init_required=not tdist.is_initialized(),  # 1 process: DeepSpeed makes one
        )
        return engine

    # Two ranks: the wall clock (waiting for the peer is part of a step). One rank: this
    # process's CPU time, which a machine shared with other jobs does not inflate.
    now = time.perf_counter if world > 1 else time.process_time

    def timed(step):  # type: ignore[no-untyped-def]
        def block() -> float:
            tdist.barrier()  # both ranks start the block together
            return per_call(step, steps, now=now)

        return block

    engine = raw_engine(SIZES)
    raw_data = itertools.cycle(pool)

    def raw_step() -> None:  # DeepSpeed's own loop
        inputs, targets = next(raw_data)
        loss = loss_fn(engine(inputs), targets)
        engine.backward(loss)
        engine.step()

    model, optimizer, scheduler = faccel.prepare(dist, *_parts(SIZES))
    fac_data = itertools.cycle(pool)

    def fac_step() -> None:  # the seed loop through faccel
        inputs, targets = next(fac_data)
        optimizer.zero_grad()
        faccel.backward(dist, loss_fn(model(inputs), targets))
        optimizer.step()
        scheduler.step()

    step_samples = interleave({RAW: timed(raw_step), FACCEL: timed(fac_step)}, rounds=rounds)
    if not saves:
        if rank == 0:
            Path(out).write_text(json.dumps({"step": step_samples}))
        faccel.shutdown(dist)
        return

    # Checkpoints of a bigger model, one Adam step taken so the moments exist.
    big_raw = raw_engine(CHECKPOINT_SIZES, adam=True)
    big, big_optimizer = faccel.prepare(dist, *adamw(CHECKPOINT_SIZES))
    x = torch.randn(BATCH, CHECKPOINT_SIZES[0])
    y = torch.randn(BATCH, 1)
    big_raw.backward(loss_fn(big_raw(x), y))
    big_raw.step()
    faccel.backward(dist, loss_fn(big(x), y))
    big_optimizer.step()
    state = faccel.TrainState.create(model=big, optimizer=big_optimizer)
    # One folder for both ranks (a local disk: the same path on every rank).
    if rank == 0:
        root = tempfile.mkdtemp(prefix="faccel-bench-deepspeed-")
        Path(out + ".root").write_text(root)
    tdist.barrier()
    root = Path(out + ".root").read_text()
    tag = itertools.count(1)

    def save(fn):  # type: ignore[no-untyped-def]
        def block() -> float:
            tdist.barrier()
            start = time.perf_counter()
            fn(next(tag))
            tdist.barrier()  # the save is done when every rank's part is
            return time.perf_counter() - start

        return block

    def faccel_save(number: int) -> None:
        import attrs

        faccel.checkpoint(dist, attrs.evolve(state, step=number), os.path.join(root, "faccel"), keep=1)

    def raw_save(number: int) -> None:
        big_raw.save_checkpoint(os.path.join(root, "deepspeed"), tag=f"t{number}")
        tdist.barrier()
        if rank == 0:  # keep one, as keep=1 does
            for old in Path(root, "deepspeed").glob("t*"):
                if old.name != f"t{number}":
                    shutil.rmtree(old)

    save_samples = interleave({RAW: save(raw_save), FACCEL: save(faccel_save)}, rounds=saves)
    tdist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        parameters = sum(p.numel() for p in big.module.parameters())
        Path(out).write_text(
            json.dumps({"step": step_samples, "save": save_samples, "parameters": parameters})
        )
    faccel.shutdown(dist)


def unavailable() -> str | None:
    """Why this benchmark cannot run here (run.py records it as skipped), or None."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed (pip install 'faccel[deepspeed]')"
    return None


def run(quick: bool) -> list[Row]:
    if unavailable() is not None:
        return []  # DeepSpeed is an optional extra: nothing to compare with
    rounds, steps, saves = (5, 20, 2) if quick else (30, 100, 8)
    found = run_ranks(_worker, (rounds, steps, saves, 2), what="DeepSpeed benchmark")
    alone = run_ranks(_worker, (rounds, steps, 0, 1), what="DeepSpeed benchmark", world_size=1)
    assert isinstance(found, dict) and isinstance(alone, dict)
    step = rows(
        f"small MLP {'-'.join(map(str, SIZES))}, batch {BATCH} per rank, ZeRO-2, 2 gloo processes "
        f"({steps} steps a block)",
        found["step"],
        baseline=RAW,
        unit="us/step",
        scale=1e6,
        goals="deepspeed_step",
    )
    save = rows(
        f"checkpoint of a ZeRO-2 run, MLP {'-'.join(map(str, CHECKPOINT_SIZES))} "
        f"({found['parameters'] / 1e6:.1f}M parameters) + AdamW, 2 gloo processes",
        found["save"],
        baseline=RAW,
        unit="s",
        notes={
            RAW: "engine.save_checkpoint: torch.save (pickle) of each rank's partitions, no fsync",
            FACCEL: "faccel.checkpoint: gathered whole, safetensors + JSON, fsynced",
        },
    )
    one = rows(
        f"the same, 1 process, CPU time ({steps} steps a block)",
        alone["step"],
        baseline=RAW,
        unit="us/step",
        scale=1e6,
        goals="deepspeed_step",
    )
    return step + one + save
