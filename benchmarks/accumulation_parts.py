"""Where accumulation's overhead goes: faccel's idiom taken apart, one call at a time.

python benchmarks/accumulation_parts.py [ROUNDS]

The accumulation benchmark's setting (the small MLP, 4 micro-steps a step, 240
micro-steps a block, one thread). Six loops run in shuffled order each round, each
adding one of faccel's calls to the manual loop: ``micro_batches`` alone, then
``backward(micro=)``, then ``accumulate``, the whole idiom on a prepared and on an
unprepared model. It prints each loop's median time per micro-step and its ratio to
the manual loop, then each call's own time timed alone (``timeit``), so the two can
be compared. The figures quoted in the README's accumulation row come from this script.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import faccel

if str(Path(__file__).resolve().parents[1]) not in sys.path:  # `python benchmarks/...py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.bench_accumulation import SIZES, STEPS, _epoch, _loss
from benchmarks.bench_step import _parts, batches

Block = Callable[[], None]


def _loops(dist: Any, epoch: list[Any]) -> dict[str, Block]:
    # Each loop is written out in full, on purpose: a shared loop with switches would time the
    # switches too, and what is measured here is a few microseconds of a 240 us micro-step.
    def manual(model: Any, optimizer: Any, scheduler: Any) -> Block:
        def block() -> None:
            for i, (inputs, targets) in enumerate(epoch):
                (_loss(model, inputs, targets) / STEPS).backward()
                if (i + 1) % STEPS == 0:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()

        return block

    def with_micro_batches(model: Any, optimizer: Any, scheduler: Any) -> Block:
        def block() -> None:
            for micro, (inputs, targets) in faccel.micro_batches(dist, epoch):
                (_loss(model, inputs, targets) / STEPS).backward()
                if micro.sync:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()

        return block

    def with_backward(model: Any, optimizer: Any, scheduler: Any) -> Block:
        def block() -> None:
            for micro, (inputs, targets) in faccel.micro_batches(dist, epoch):
                faccel.backward(dist, _loss(model, inputs, targets), micro=micro)
                if micro.sync:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()

        return block

    def idiom(model: Any, optimizer: Any, scheduler: Any) -> Block:
        def block() -> None:
            for micro, (inputs, targets) in faccel.micro_batches(dist, epoch):
                with faccel.accumulate(dist, model, micro):
                    faccel.backward(dist, _loss(model, inputs, targets), micro=micro)
                if micro.sync:
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()

        return block

    prepared = faccel.prepare(dist, *_parts(SIZES))
    return {
        "manual": manual(*_parts(SIZES)),
        "manual, prepared model": manual(*prepared),
        "+ micro_batches": with_micro_batches(*prepared),
        "+ backward(micro=)": with_backward(*prepared),
        "+ accumulate (faccel's idiom)": idiom(*prepared),
        "faccel's idiom, unprepared model": idiom(*_parts(SIZES)),
    }


def main(rounds: int = 60) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist = faccel.detect({}, accumulation_steps=STEPS)
    epoch = _epoch(batches(SIZES, 32, classes=False), 240)
    loops = _loops(dist, epoch)
    for block in loops.values():  # warm-up
        block()
        block()
    times: dict[str, list[float]] = {name: [] for name in loops}
    order = list(loops)
    for r in range(rounds):
        random.Random(r).shuffle(order)
        for name in order:
            start = time.perf_counter()
            loops[name]()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["manual"])
    print(f"per micro-step, median of {rounds} rounds of {len(epoch)} micro-steps:")
    for name, seconds in times.items():
        median = statistics.median(seconds)
        print(f"  {name:34s} {median / len(epoch) * 1e6:7.1f} us  {median / base:.4f}")
    items = list(range(len(epoch)))
    model = torch.nn.Linear(1, 1)
    micro = next(iter(faccel.micro_batches(dist, items)))[0]
    loss = torch.zeros((), requires_grad=True)

    def walk() -> None:
        for _ in faccel.micro_batches(dist, items):
            pass

    def faccel_backward() -> None:
        faccel.backward(dist, loss * 1.0, micro=micro)

    def torch_backward() -> None:
        (loss * 1.0 / STEPS).backward()

    # A scalar's backward takes tens of microseconds and drifts: the two alternate, and the
    # median of the paired differences is faccel's part.
    differences = []
    for _ in range(40):
        mine = timeit.timeit(faccel_backward, number=500) / 500
        differences.append(mine - timeit.timeit(torch_backward, number=500) / 500)
    alone = {
        "micro_batches, a micro-step": timeit.timeit(walk, number=200) / 200 / len(items),
        "accumulate, enter and exit": timeit.timeit(
            lambda: faccel.accumulate(dist, model, micro).__enter__(), number=20000
        )
        / 20000,
        "backward(micro=) beyond torch's": statistics.median(differences),
    }
    print("each call timed alone (timeit):")
    for name, seconds in alone.items():
        print(f"  {name:34s} {seconds * 1e6:7.2f} us")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 60)
