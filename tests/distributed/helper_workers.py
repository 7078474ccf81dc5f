"""What the two-rank tests of Accelerate's helpers run on every rank."""

from __future__ import annotations

import torch

import faccel


def batch_size_one_rank_oom() -> dict:
    """Rank 1 alone runs out of memory above 40: both ranks settle on the same size."""
    dist = faccel.detect()
    sizes = []

    @faccel.find_executable_batch_size(dist, starting_batch_size=64)
    def train(batch_size: int) -> int:
        sizes.append(batch_size)
        if dist.rank == 1 and batch_size > 40:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return batch_size

    return {"rank": dist.rank, "result": train(), "tried": sizes}


def comm_hook_step(hook: str | None) -> dict:
    """One DDP step with ``hook``; the hook DDP reports and the weights after it."""
    dist = faccel.detect()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    options = {"start_powerSGD_iter": 2, "matrix_approximation_rank": 1} if hook == "powersgd" else None
    model = faccel.prepare(dist, model, comm_hook=hook, comm_hook_options=options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.rank)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).square().sum()
        faccel.backward(dist, loss)
        optimizer.step()
        optimizer.zero_grad()
    logged = model._get_ddp_logging_data().get("comm_hook", "")
    return {"rank": dist.rank, "hook": logged, "weight": faccel.unwrap_model(model).weight.flatten().tolist()}


def local_sgd_run(every: int, steps: int) -> dict:
    """LocalSGD on 2 ranks, other data on each: they differ between averages, agree after the block."""
    dist = faccel.detect()
    torch.manual_seed(0)
    model = faccel.prepare(dist, torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(10 + dist.rank)
    weights, averaged = [], []
    with faccel.local_sgd(dist, model, every=every) as local:
        for step in range(1, steps + 1):
            loss = model(torch.randn(8, 4)).square().mean()
            faccel.backward(dist, loss)
            optimizer.step()
            optimizer.zero_grad()
            averaged.append(local.step(step))
            weights.append(faccel.unwrap_model(model).weight.flatten().tolist())
    final = faccel.unwrap_model(model).weight.flatten().tolist()
    return {"rank": dist.rank, "weights": weights, "averaged": averaged, "final": final}


def profile_run(root: str) -> dict:
    """Each rank writes its own trace; a scheduled run writes one per active cycle."""
    import os

    dist = faccel.detect()
    with faccel.profile(dist, os.path.join(root, "plain")):
        torch.ones(16, 16) @ torch.ones(16, 16)
    with faccel.profile(
        dist, os.path.join(root, "scheduled"), schedule={"wait": 1, "active": 1, "repeat": 2}
    ) as p:
        for _ in range(4):
            torch.ones(16, 16) @ torch.ones(16, 16)
            p.step()
    return {"rank": dist.rank}


def accelerate_schedule(steps: int) -> dict:
    """A warmup schedule written for Accelerate, stepped the Accelerate way on 2 ranks."""
    dist = faccel.detect()
    torch.manual_seed(0)
    model = faccel.prepare(dist, torch.nn.Linear(2, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda n: min(1.0, n / 8))
    lrs = []
    for _ in range(steps):
        faccel.backward(dist, model(torch.ones(1, 2)).sum())
        n = faccel.accelerate_scheduler_steps(dist)
        faccel.optimizer_step(dist, optimizer, scheduler=scheduler, scheduler_steps=n)
        optimizer.zero_grad()
        lrs.append(scheduler.get_last_lr()[0])
    return {"rank": dist.rank, "lrs": lrs}


def _caught(work) -> str:
    """The faccel error ``work()`` raised, as ``Class: message``; '' when it returned."""
    try:
        work()
    except faccel.errors.FaccelError as error:
        return f"{type(error).__name__}: {error}"
    return ""


def options_that_differ_per_rank() -> dict:
    """Each option that must agree, given differently on rank 1: refused on every rank, weights untouched.

    One launch for all of them: each refusal leaves the process group usable for the next.
    """
    dist = faccel.detect()
    other = dist.rank == 1
    torch.manual_seed(0)
    out: dict = {"rank": dist.rank}
    rank = 2 if other else 1
    options = {"start_powerSGD_iter": 2, "matrix_approximation_rank": rank}
    out["comm_hook_options"] = _caught(
        lambda: faccel.prepare(dist, torch.nn.Linear(4, 4), comm_hook="powersgd", comm_hook_options=options)
    )
    model = faccel.prepare(dist, torch.nn.Linear(4, 1))
    before = faccel.unwrap_model(model).weight.flatten().tolist()

    def block(**kwargs) -> None:
        with faccel.local_sgd(dist, model, **kwargs):
            pass

    out["enabled"] = _caught(lambda: block(every=2, enabled=not other))
    out["every"] = _caught(lambda: block(every=3 if other else 2))

    def steps() -> None:
        with faccel.local_sgd(dist, model, every=1) as local:
            local.step(2 if other else 1)

    out["step"] = _caught(steps)
    out["untouched"] = faccel.unwrap_model(model).weight.flatten().tolist() == before
    # A PowerSGD hook's buffers are dropped at shutdown (torch cannot take the hook off DDP).
    hooked = faccel.prepare(
        dist, torch.nn.Linear(8, 8), comm_hook="powersgd", comm_hook_options={"start_powerSGD_iter": 2}
    )
    for _ in range(3):
        faccel.backward(dist, hooked(torch.randn(4, 8)).square().sum())
    state = hooked._faccel_comm_hook
    out["error_feedback"] = [len(state.error_dict)]
    faccel.shutdown(dist)
    out["error_feedback"].append(len(state.error_dict))
    return out
