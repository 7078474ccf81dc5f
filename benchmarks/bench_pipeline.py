"""Two-process pipeline stages over gloo: faccel's pipelined step vs the same schedule by hand.

Two processes are spawned (``pipeline=2``). For each schedule (GPipe, 1F1B; 4 micro-batches) and
each size (width 64 with a batch of 16, where a step is mostly the messages' latency; width 512
with a batch of 64) each rank trains a model of an input layer, four blocks and a read-out,
cut after block 2, four ways: three times by hand with ``torch.distributed.pipelining`` (the stage built
the way torchtitan builds one, a ``PipelineStage`` over the default group, the schedule's ``step``
with the batch on the first stage and the targets on the last, ``optimizer.step()``), and once
through ``faccel.prepare(..., split=build, schedule=faccel.Schedule(...))`` and
``faccel.forward_backward``, with the optimizer built over the model given to ``prepare`` (it
steps this rank's stage, as the hand-written one does).

The same result on both sides: ``forward_backward`` returns the batch's loss on every rank, so the
hand-written step also makes it, the way a loop by hand must to log it on rank 0: the mean of the
last stage's micro-batch losses, ``torch.distributed.broadcast`` from the last stage to every rank.
(Without it the hand-written step would leave the loss on the last stage only, where rank 0's log
line cannot read it.) A third hand-written model skips that, leaving the loss on the last stage,
for reference: what making the loss on every rank costs. faccel's own work beyond the baseline is
its loss scaling (each micro-batch's loss times the accumulation factor; torch's ``scale_grads``
divides the gradients instead on the hand-written side).
Blocks of steps alternate between them (order rotating); rank 0 times them with the wall clock. The
second hand-written model's ratio to the first is the noise floor.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import FACCEL, Row, interleave, per_call, rank_env, rows, run_ranks

RAW = "torch.distributed.pipelining by hand"
AGAIN = "by hand, again"
BARE = "by hand, the loss left on the last stage"
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
WORLD, MICRO = 2, 4
# (width, batch) of each case: a toy step that is mostly latency, and one with some arithmetic in it.
SIZES = ((64, 16), (512, 64))


def _stage(stage: int, stages: int, width: int) -> Any:
    import torch
    from torch import nn

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(stage)
            self.embed = nn.Linear(8, width) if stage == 0 else None
            first = stage * 4 // stages
            self.layers = nn.ModuleDict(
                {str(i): nn.Linear(width, width) for i in range(first, first + 4 // stages)}
            )
            self.head = nn.Linear(width, 1) if stage == stages - 1 else None

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            if self.embed is not None:
                h = self.embed(h)
            for layer in self.layers.values():
                h = torch.tanh(layer(h))
            return self.head(h) if self.head is not None else h

    return Stage()


def _whole(width: int) -> Any:
    """The whole model, by the names its stages keep (faccel's prepare takes it, and its optimizer)."""
    from torch import nn

    whole = nn.Module()
    parts = [_stage(s, WORLD, width) for s in range(WORLD)]
    whole.embed = parts[0].embed
    whole.layers = nn.ModuleDict({k: v for p in parts for k, v in p.layers.items()})
    whole.head = parts[-1].head
    return whole


def _worker(rank: int, port: int, plan: tuple[int, int], out: str) -> None:
    os.environ.update(rank_env(rank, port, world_size=WORLD))
    import torch
    from torch.distributed import pipelining

    import faccel

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    rounds, steps = plan
    dist = faccel.detect(layout=f"pipeline={WORLD}")
    generator = torch.Generator().manual_seed(1)
    mse = torch.nn.functional.mse_loss
    results: dict[str, dict[str, list[float]]] = {}
    for (width, batch), (kind, cls) in itertools.product(SIZES, SCHEDULES.items()):
        pool = [
            (torch.randn(batch, 8, generator=generator), torch.randn(batch, 1, generator=generator))
            for _ in range(4)
        ]
        blocks = {}
        for name in (RAW, AGAIN, BARE):
            module = _stage(rank, WORLD, width)
            optimizer = torch.optim.SGD(module.parameters(), lr=0.01)
            stage = pipelining.PipelineStage(module, rank, WORLD, dist.device)
            schedule = getattr(pipelining, cls)(stage, n_microbatches=MICRO, loss_fn=mse)
            by_hand = functools.partial(_by_hand, rank, schedule, optimizer, share=name != BARE)
            blocks[name] = _timed(by_hand, pool, steps)
        # The optimizer over the very model given to prepare: faccel points it at this rank's stage.
        whole = _whole(width)
        model, optimizer = faccel.prepare(
            dist,
            whole,
            torch.optim.SGD(whole.parameters(), lr=0.01),
            split=lambda stage, stages, width=width: _stage(stage, stages, width),
            schedule=faccel.Schedule(kind=kind, microbatches=MICRO),
        )

        def through_faccel(batch: Any, model: Any = model, optimizer: Any = optimizer) -> None:
            optimizer.zero_grad()
            faccel.forward_backward(dist, model, mse, *batch)
            optimizer.step()

        blocks[FACCEL] = _timed(through_faccel, pool, steps)
        results[f"{width}/{kind}"] = interleave(blocks, rounds=rounds)
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    faccel.shutdown(dist)


def _by_hand(rank: int, schedule: Any, optimizer: Any, batch: Any, *, share: bool) -> None:
    import torch
    import torch.distributed as tdist

    inputs, targets = batch
    optimizer.zero_grad()
    losses: list[Any] = []
    if rank == 0:
        schedule.step(inputs)
    else:
        schedule.step(target=targets, losses=losses)
    if share:  # the batch's loss on every rank, as forward_backward returns it: where rank 0 can log it
        loss = torch.stack(losses).detach().mean() if losses else torch.empty(())
        tdist.broadcast(loss, src=WORLD - 1)
    optimizer.step()


def _timed(step: Any, pool: list[Any], steps: int) -> Any:
    import torch.distributed as tdist

    data = itertools.cycle(pool)

    def timed() -> float:
        tdist.barrier()
        return per_call(lambda: step(next(data)), steps, now=time.perf_counter)

    return timed


def run(quick: bool) -> list[Row]:
    plan = (4, 8) if quick else (15, 30)
    samples: Any = run_ranks(_worker, plan, what="pipeline benchmark", world_size=WORLD)
    out: list[Row] = []
    for (width, batch), kind in itertools.product(SIZES, SCHEDULES):
        out += rows(
            f"pipeline=2, {kind}, {MICRO} micro-batches of {batch // MICRO}, width {width}, "
            f"{WORLD} gloo processes ({plan[1]} steps a block)",
            samples[f"{width}/{kind}"],
            baseline=RAW,
            unit="ms/step",
            scale=1e3,
            goals="parallel_step",
            notes={
                AGAIN: "the noise floor: the same step as the baseline, another model",
                BARE: "no loss on rank 0: less than forward_backward returns, for reference",
            },
        )
    return out


if __name__ == "__main__":
    import sys

    for row in run(quick="--quick" in sys.argv):
        print(row)
