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
