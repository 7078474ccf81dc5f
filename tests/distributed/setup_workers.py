"""Workers for tests/distributed/test_setup_consistency.py: ranks given different set-ups at prepare.

Every case runs in the same process group, one after another (a refusal leaves the group usable),
and records what each rank's ``prepare`` raised; the last one prepares matching objects and trains a
step, so the check neither refuses the same set-up nor breaks the group.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import faccel


def _rank() -> int:
    return int(os.environ["RANK"])


def _model(width: int = 16) -> nn.Module:
    return nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))


def _plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _loader(n: int) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    data = torch.utils.data.TensorDataset(torch.randn(n, 8), torch.randn(n, 1))
    return torch.utils.data.DataLoader(data, batch_size=4)


def _outcome(call: Callable[[], Any]) -> list[Any]:
    try:
        call()
    except Exception as error:
        return [type(error).__name__, str(error), isinstance(error, faccel.errors.FaccelError)]
    return ["no error", "", False]


def mismatches(*, strategy: str, layout: str | None) -> dict[str, Any]:
    """Each mismatch case's outcome on this rank, then a matching prepare and one step."""
    kwargs: dict[str, Any] = {"strategy": strategy}
    if layout is not None:
        kwargs["layout"] = layout
    dist = faccel.detect(**kwargs)
    wide = 24 if _rank() == 1 else 16
    plan = _plan() if dist.parallel.tensor > 1 else None

    def on_meta() -> nn.Module:
        with torch.device("meta"):
            return _model(wide)

    def precision() -> Any:
        if _rank() == 1:  # FACCEL_PRECISION set on one node only
            os.environ["FACCEL_PRECISION"] = "bf16"
        try:
            other = faccel.detect(**kwargs)
        finally:
            os.environ.pop("FACCEL_PRECISION", None)
        return faccel.prepare(other, _model(), tp_plan=plan)

    def two_groups() -> Any:
        model = _model()
        first, second = list(model.parameters())[:2], list(model.parameters())[2:]
        groups = [{"params": first}, {"params": second}] if _rank() == 1 else [{"params": [*first, *second]}]
        return faccel.prepare(dist, torch.optim.SGD(groups, lr=0.1))

    def kinds() -> Any:
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return faccel.prepare(dist, model, optimizer) if _rank() == 0 else faccel.prepare(dist, model)

    cases: dict[str, Callable[[], Any]] = {
        "wider model": lambda: faccel.prepare(dist, _model(wide), tp_plan=plan),
        "wider model on meta": lambda: faccel.prepare(dist, on_meta(), tp_plan=plan),
        "learning rate": lambda: faccel.prepare(
            dist, torch.optim.SGD(_model().parameters(), lr=0.2 if _rank() == 1 else 0.1)
        ),
        "optimizer groups": two_groups,
        "loader length": lambda: faccel.prepare(dist, _loader(48 if _rank() == 1 else 40)),
        "objects": kinds,
        "precision": precision,
    }
    out: dict[str, Any] = {name: _outcome(call) for name, call in cases.items()}
    # The same set-up on every rank: prepared, and a step of training runs over the group.
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, _loader(40), tp_plan=plan)
    x, y = next(iter(loader))
    faccel.backward(dist, nn.functional.mse_loss(model(x), y))
    optimizer.step()
    out["trained"] = True
    return out


def cost(*, depth: int, repeats: int = 5) -> dict[str, float]:
    """Seconds of ``prepare`` (DDP, gloo) of a ``depth``-layer MLP: with the check, without it, and the check.

    Without: the same ``prepare`` with ``_prepare``'s ``check_setup`` swapped for a no-op, alternating
    with the real one call by call (a measurement, not a test).
    """
    from faccel._loop import _prepare
    from faccel._loop._consistency import check_setup
    from faccel._loop._options import PrepareOptions

    dist = faccel.detect()

    def build() -> tuple[nn.Module, torch.optim.Optimizer, Any]:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(64, 64) for _ in range(depth)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), _loader(64)

    def timed(call: Callable[[], Any]) -> float:
        faccel.wait_for_everyone(dist)
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    seconds: dict[str, list[float]] = {"check": [], "with": [], "without": []}
    for _ in range(repeats):
        objs, other = build(), build()
        seconds["check"].append(timed(lambda objs=objs: check_setup(dist, objs, PrepareOptions())))
        seconds["with"].append(timed(lambda objs=objs: faccel.prepare(dist, *objs)))
        _prepare.check_setup = lambda *args: None  # type: ignore[assignment]
        try:
            seconds["without"].append(timed(lambda other=other: faccel.prepare(dist, *other)))
        finally:
            _prepare.check_setup = check_setup
    return {key: sorted(values)[len(values) // 2] for key, values in seconds.items()}


class _SeededSampler(torch.utils.data.Sampler[int]):
    """A custom sampler whose order comes from its own seed and the epoch (a set_epoch sampler)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        generator = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=generator).tolist())

    def __len__(self) -> int:
        return self.n


def _data(n: int = 40) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.randn(n, 8), torch.randn(n, 1))


def _linears(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def _nothing(module: nn.Module) -> bool:
    return False


def orders() -> dict[str, Any]:
    """What silently broke training although the set-up check ran (FSDP2, 2 ranks).

    Each case's outcome on this rank, then one matching prepare of all of it and a step.
    """
    dist = faccel.detect(strategy="fsdp")
    one = _rank() == 1

    def sgd() -> torch.optim.Optimizer:
        return torch.optim.SGD(_model().parameters(), lr=0.1)

    cases: dict[str, Callable[[], Any]] = {
        "shuffle": lambda: faccel.prepare(
            dist, torch.utils.data.DataLoader(_data(), batch_size=4, shuffle=not one)
        ),
        "replacement": lambda: faccel.prepare(
            dist,
            torch.utils.data.DataLoader(
                _data(), batch_size=4, sampler=torch.utils.data.RandomSampler(_data(), replacement=one)
            ),
        ),
        "sampler seed": lambda: faccel.prepare(
            dist,
            torch.utils.data.DataLoader(_data(), batch_size=4, sampler=_SeededSampler(40, 2 if one else 1)),
        ),
        "sampler class": lambda: faccel.prepare(
            dist,
            torch.utils.data.DataLoader(
                _data(), batch_size=4, sampler=_SeededSampler(40, 1) if one else None, shuffle=not one
            ),
        ),
        "StepLR gamma": lambda: faccel.prepare(
            dist, torch.optim.lr_scheduler.StepLR(sgd(), step_size=2, gamma=0.9 if one else 0.5)
        ),
        "cosine T_max": lambda: faccel.prepare(
            dist, torch.optim.lr_scheduler.CosineAnnealingLR(sgd(), T_max=20 if one else 10)
        ),
        "shard_policy": lambda: faccel.prepare(dist, _model(), shard_policy=_nothing if one else _linears),
    }
    out: dict[str, Any] = {name: _outcome(call) for name, call in cases.items()}
    # The same set-up on every rank (a shuffled loader, a StepLR, a shard policy) is not refused.
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(_data(), batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = faccel.prepare(
        dist, model, optimizer, scheduler, loader, shard_policy=_linears
    )
    x, y = next(iter(loader.at(epoch=0)))
    faccel.backward(dist, nn.functional.mse_loss(model(x), y))
    optimizer.step()
    scheduler.step()
    out["trained"] = True
    return out
