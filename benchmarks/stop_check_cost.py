"""What a per-step stop check costs: ``faccel.any_rank(dist, stop.received)`` on 2 gloo ranks.

python benchmarks/stop_check_cost.py

Two processes (``faccel.launch``) train the benchmarks' small MLP under DDP.
Blocks of steps alternate between a plain step and the same step followed by
the check (a one-element all_reduce); rank 0 prints the median step time of
each and their ratio, and the check's own time. The figures quoted in
docs/preemption.md come from this script.
"""

from __future__ import annotations

import json
import statistics
import time


def _measure(rounds: int, steps: int) -> dict[str, float]:
    import torch

    import faccel

    torch.set_num_threads(1)
    dist = faccel.detect()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    inputs, targets = torch.randn(32, 32), torch.randn(32, 1)
    stop = faccel.stop_signal(dist)

    def step(check: bool) -> None:
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(inputs), targets))
        optimizer.step()
        if check and faccel.any_rank(dist, stop.received):
            raise SystemExit(0)

    times: dict[bool, list[float]] = {False: [], True: []}
    for round_ in range(rounds):
        for check in (round_ % 2 == 0, round_ % 2 == 1):  # the order alternates
            faccel.wait_for_everyone(dist)
            start = time.perf_counter()
            for _ in range(steps):
                step(check)
            times[check].append((time.perf_counter() - start) / steps)
    checks = []
    for _ in range(rounds):
        faccel.wait_for_everyone(dist)
        start = time.perf_counter()
        for _ in range(steps):
            faccel.any_rank(dist, stop.received)
        checks.append((time.perf_counter() - start) / steps)
    stop.close()
    plain, checked = statistics.median(times[False]), statistics.median(times[True])
    ratios = [c / p for c, p in zip(times[True], times[False], strict=True)]
    return {
        "step_us": plain * 1e6,
        "step_with_check_us": checked * 1e6,
        "ratio_median": statistics.median(ratios),
        "ratio_low": min(ratios),
        "ratio_high": max(ratios),
        "check_us": statistics.median(checks) * 1e6,
    }


def main() -> None:
    import faccel

    print(json.dumps(faccel.launch(_measure, nprocs=2, kwargs={"rounds": 11, "steps": 200}), indent=1))


if __name__ == "__main__":
    main()
