"""Functions that the two-process tests run on every rank (module level, so picklable)."""

from __future__ import annotations

from typing import Any

import torch


def seed_task(n: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed loop's synthetic regression task: y = x @ w + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    w = torch.randn(8, 1, generator=g)
    return x, x @ w + 0.01 * torch.randn(n, 1, generator=g)


def seed_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def seed_loop(steps_per_epoch_batch: int = 8, epochs: int = 2) -> dict[str, Any]:
    """The seed loop under faccel; returns the final parameters and what detect saw."""
    import faccel

    dist = faccel.detect()
    x, y = seed_task()
    model = seed_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=steps_per_epoch_batch
    )
    model, optimizer, loader, scheduler = faccel.prepare(dist, model, optimizer, loader, scheduler)
    steps = 0
    for epoch in range(epochs):
        for inputs, targets in loader.at(epoch=epoch):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            faccel.backward(dist, loss)
            optimizer.step()
            scheduler.step()
            steps += 1
    params = [p.detach().flatten().tolist() for p in faccel.unwrap_model(model).parameters()]
    return {
        "rank": dist.rank,
        "world_size": dist.world_size,
        "launcher": dist.launcher,
        "wrapped": type(model).__name__,
        "steps": steps,
        "last_epoch": scheduler.last_epoch,
        "params": params,
    }


def barrier_order(path: str) -> int:
    """main_process_first: the main process writes first, the other appends after."""
    import faccel

    dist = faccel.detect()
    with faccel.main_process_first(dist), open(path, "a") as handle:
        handle.write(str(dist.rank))
    faccel.wait_for_everyone(dist)
    return dist.rank


def accumulation_loop(accumulation_steps: int = 2, batch_size: int = 4, epochs: int = 1) -> dict[str, Any]:
    """The accumulation idiom on DDP, counting the all-reduces DDP really issues."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import faccel

    dist = faccel.detect(accumulation_steps=accumulation_steps)
    x, y = seed_task(n=56)
    model = seed_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch_size)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
    all_reduces: list[int] = []

    def counting_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
        all_reduces.append(1)
        return default_hooks.allreduce_hook(None, bucket)

    model.register_comm_hook(None, counting_hook)
    syncs = 0
    for epoch in range(epochs):
        for micro, (inputs, targets) in faccel.micro_batches(dist, loader.at(epoch=epoch)):
            with faccel.accumulate(dist, model, micro):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                faccel.backward(dist, loss, micro=micro)
            if micro.sync:
                syncs += 1
                faccel.optimizer_step(dist, optimizer)
                optimizer.zero_grad()
    return {
        "syncs": syncs,
        "micro_steps": len(loader) * epochs,
        "all_reduces": len(all_reduces),
        "params": [p.detach().flatten().tolist() for p in faccel.unwrap_model(model).parameters()],
    }


class Blocks(torch.nn.Module):
    """A tiny model with a ModuleList of blocks, the shape FSDP2's default policy shards."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()) for _ in range(3)
        )
        self.out = torch.nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def full_params(model: torch.nn.Module) -> list[list[float]]:
    """Every parameter as a flat list, gathering FSDP2's DTensor shards."""
    out = []
    for p in model.parameters():
        tensor = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(tensor.detach().flatten().tolist())
    return out


def strategy_loop(strategy: str, accumulation_steps: int = 1, steps: int = 6) -> dict[str, Any]:
    """The same training (AdamW, clipping, accumulation) under DDP or FSDP2."""
    import faccel

    dist = faccel.detect(strategy=strategy, accumulation_steps=accumulation_steps)
    x, y = seed_task(n=96)
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
    norms = []
    for micro, (inputs, targets) in faccel.micro_batches(dist, loader):
        with faccel.accumulate(dist, model, micro):
            faccel.backward(dist, torch.nn.functional.mse_loss(model(inputs), targets), micro=micro)
        if micro.sync:
            norms.append(faccel.clip_grad_norm(dist, model, 0.5).item())
            faccel.optimizer_step(dist, optimizer)
            optimizer.zero_grad()
            if len(norms) == steps:
                break
    sharded = [type(p).__name__ for p in model.parameters()]
    return {"params": full_params(model), "norms": norms, "param_types": sorted(set(sharded))}


def fsdp_prepare_orders(steps: int = 3) -> dict[str, Any]:
    """FSDP2: the model and its optimizer prepared in every order and split of prepare calls."""
    import faccel

    dist = faccel.detect(strategy="fsdp")
    x, y = seed_task(n=32)
    shard = slice(dist.rank * 8, dist.rank * 8 + 8)

    def together(model: Any, opt: Any) -> tuple[Any, Any]:
        return faccel.prepare(dist, model, opt)

    def optimizer_first(model: Any, opt: Any) -> tuple[Any, Any]:
        opt, model = faccel.prepare(dist, opt, model)
        return model, opt

    def model_then_optimizer(model: Any, opt: Any) -> tuple[Any, Any]:
        model = faccel.prepare(dist, model)
        return model, faccel.prepare(dist, opt)

    def optimizer_then_model(model: Any, opt: Any) -> tuple[Any, Any]:
        opt = faccel.prepare(dist, opt)
        return faccel.prepare(dist, model), opt

    results = {}
    for order in (together, optimizer_first, model_then_optimizer, optimizer_then_model):
        torch.manual_seed(0)
        model = Blocks()
        initial = [p.detach().flatten().tolist() for p in model.parameters()]
        model, optimizer = order(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        for _ in range(steps):
            optimizer.zero_grad()
            faccel.backward(dist, torch.nn.functional.mse_loss(model(x[shard]), y[shard]))
            optimizer.step()
        results[order.__name__] = {
            "params": full_params(model),
            "initial": initial,
            "stepped": [type(p).__name__ for group in optimizer.param_groups for p in group["params"]],
        }
    return results


def _train_blocks(dist: Any, steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import faccel

    x, y = seed_task(n=32)
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    model, optimizer = faccel.prepare(dist, model, optimizer)
    shard = slice(dist.rank * 8, dist.rank * 8 + 8)
    for _ in range(steps):
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(x[shard]), y[shard]))
        optimizer.step()
    return model, optimizer


def sharded_state_round_trip() -> dict[str, Any]:
    """FSDP2 on 2 ranks: gather whole state dicts, scatter them into a fresh sharded model."""
    import faccel
    from faccel._checkpoint._strategies._fsdp import full_state, load_full_state

    dist = faccel.detect(strategy="fsdp")
    model, optimizer = _train_blocks(dist)
    model_state, optimizer_state = full_state(model, optimizer)
    # every rank needs the whole dicts to load: rank 0's, as plain lists through the store
    whole = [None]
    if dist.rank == 0:
        whole = [({k: v.tolist() for k, v in model_state.items()}, _plain(optimizer_state))]
    torch.distributed.broadcast_object_list(whole, src=0)
    saved_model = {k: torch.tensor(v) for k, v in whole[0][0].items()}
    saved_opt = _tensors(whole[0][1])
    torch.manual_seed(1)
    fresh = Blocks()
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    fresh, fresh_opt = faccel.prepare(dist, fresh, fresh_opt)
    load_full_state(fresh, fresh_opt, saved_model, saved_opt)
    return {
        "rank": dist.rank,
        "model_state": whole[0][0],
        "optimizer_state": whole[0][1],
        "trained": full_params(model),
        "loaded": full_params(fresh),
        "betas": list(fresh_opt.param_groups[0]["betas"]),
        "betas_is_tuple": isinstance(fresh_opt.param_groups[0]["betas"], tuple),
        "lr": fresh_opt.param_groups[0]["lr"],
        "exp_avg_equal": all(
            torch.equal(a["exp_avg"].full_tensor(), b["exp_avg"].full_tensor())
            for a, b in zip(
                (optimizer.state[p] for p in model.parameters()),
                (fresh_opt.state[p] for p in fresh.parameters()),
                strict=True,
            )
        ),
    }


def _plain(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return {"__t__": tree.tolist(), "dtype": str(tree.dtype)}
    if isinstance(tree, dict):
        return {str(k): _plain(v) for k, v in tree.items()}
    if isinstance(tree, tuple):
        return {"__tuple__": [_plain(v) for v in tree]}
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    return tree


def _tensors(tree: Any) -> Any:
    if isinstance(tree, dict) and "__tuple__" in tree:
        return tuple(_tensors(v) for v in tree["__tuple__"])
    if isinstance(tree, dict) and "__t__" in tree:
        return torch.tensor(tree["__t__"], dtype=getattr(torch, tree["dtype"].split(".")[1]))
    if isinstance(tree, dict):
        return {(int(k) if k.isdigit() else k): _tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tensors(v) for v in tree]
    return tree


def _fsdp_run(dist: Any, root: str | None, stop: int | None, total: int, resume: bool) -> Any:
    """Train Blocks under FSDP2 for `total` optimizer steps over a shuffled prepared loader,
    checkpointing at `stop` (and returning there), or resuming from `root` first."""
    import attrs

    import faccel

    x, y = seed_task(n=40)
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.85, 0.99))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, scheduler, loader = faccel.prepare(dist, model, optimizer, scheduler, loader)
    state = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)
    if resume:
        state = faccel.restore(dist, state, root)
    while state.step < total:
        for inputs, targets in loader.at(epoch=state.epoch, start=state.position):
            optimizer.zero_grad()
            faccel.backward(dist, torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            scheduler.step()
            state = attrs.evolve(state, step=state.step + 1, position=state.position + 1)
            if state.step == stop:
                faccel.checkpoint(dist, state, root)
                return state
            if state.step == total:
                return state
        state = attrs.evolve(state, epoch=state.epoch + 1, position=0)
    return state


def fsdp_checkpoint(
    root: str, stop: int, total: int, model_dir: str, boundary_root: str | None = None
) -> dict[str, Any]:
    """Uninterrupted vs stop-checkpoint-restore-continue under FSDP2; plus save_model.

    ``boundary_root``: the stopped state is also checkpointed there as at an epoch
    boundary (the next epoch, batch 0), which another world size may restore.
    """
    import attrs

    import faccel

    dist = faccel.detect(strategy="fsdp")
    reference = _fsdp_run(dist, None, None, total, resume=False)
    stopped = _fsdp_run(dist, root, stop, total, resume=False)
    at_stop = full_params(stopped.model)
    if boundary_root is not None:
        boundary = attrs.evolve(stopped, epoch=stopped.epoch + 1, position=0)
        faccel.checkpoint(dist, boundary, boundary_root)
    faccel.save_model(dist, stopped.model, model_dir)
    resumed = _fsdp_run(dist, root, None, total, resume=True)
    return {
        "reference": full_params(reference.model),
        "resumed": full_params(resumed.model),
        "at_stop": at_stop,
        "stop_epoch_position": [stopped.epoch, stopped.position],
        "lr": resumed.optimizer.param_groups[0]["lr"],
        "reference_lr": reference.optimizer.param_groups[0]["lr"],
        "param_types": sorted({type(p).__name__ for p in resumed.model.parameters()}),
    }


def prepare_twice() -> dict[str, Any]:
    """The same module prepared twice under DDP; and a copy of it prepared after."""
    import copy

    import faccel

    dist = faccel.detect()
    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    first = faccel.prepare(dist, model)
    again = faccel.prepare(dist, model)
    copied = faccel.prepare(dist, copy.deepcopy(model))
    other = faccel.DistState.simulated(rank=dist.rank, world_size=dist.world_size)
    try:
        faccel.prepare(other, model)
        refused = ""
    except faccel.errors.PrepareError as error:
        refused = str(error)
    return {
        "same_wrapper": again is first,
        "copy_wrapped_apart": copied is not first and faccel.unwrap_model(copied) is not model,
        "refused": refused,
    }


def schedule_sized_after_prepare(epochs: int = 3, accumulation_steps: int = 2) -> dict[str, Any]:
    """The documented way to size a OneCycleLR: after prepare, from faccel.steps_per_epoch."""
    import faccel

    dist = faccel.detect(accumulation_steps=accumulation_steps)
    x, y = seed_task(n=56)
    model = seed_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    raw = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, raw)
    try:
        faccel.steps_per_epoch(dist, raw)
        refused = ""
    except faccel.errors.ArgumentError as error:
        refused = str(error)
    total = epochs * faccel.steps_per_epoch(dist, loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)
    steps = 0
    for epoch in range(epochs):
        for micro, (inputs, targets) in faccel.micro_batches(dist, loader.at(epoch=epoch)):
            with faccel.accumulate(dist, model, micro):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                faccel.backward(dist, loss, micro=micro)
            if micro.sync:
                last_used = optimizer.param_groups[0]["lr"]
                faccel.optimizer_step(dist, optimizer, scheduler=scheduler)
                optimizer.zero_grad()
                steps += 1
    return {
        "raw_len": len(raw),
        "len": len(loader),
        "total": total,
        "steps": steps,
        "last_lr": last_used,
        "refused": refused,
    }
