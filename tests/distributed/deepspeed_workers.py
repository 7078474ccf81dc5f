"""Workers of the DeepSpeed tests: the seed loop under strategy='deepspeed' and the same under DDP.

Imported only by tests/distributed/test_deepspeed.py, which skips without deepspeed;
deepspeed itself is imported inside faccel's engine module when the engine is built.
"""

from __future__ import annotations

import os
from typing import Any

import torch


def _task() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=generator)
    y = x @ torch.randn(6, 2, generator=generator) + 0.1 * torch.randn(96, 2, generator=generator)
    return x, y


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def seed_loop(
    *, strategy: str, stage: int = 2, accumulation_steps: int = 1, steps: int = 6, config: Any = None
) -> dict[str, Any]:
    """The seed loop (micro-steps when accumulating) for ``steps`` optimizer steps; the weights at the end."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import faccel

    options: dict[str, Any] = {}
    if strategy == "deepspeed":
        options["deepspeed"] = config if config is not None else {"zero_optimization": {"stage": stage}}
    dist = faccel.detect(strategy=strategy, accumulation_steps=accumulation_steps, **options)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    x, y = _task()
    raw = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = faccel.prepare(dist, model, optimizer, raw, scheduler)
    done = 0
    for micro, (inputs, targets) in faccel.micro_batches(dist, loader.at(epoch=0)):
        with faccel.accumulate(dist, model, micro):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            faccel.backward(dist, loss, micro=micro)
        if micro.sync:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                break
    result: dict[str, Any] = {
        "kind": type(model).__name__,
        "lr": optimizer.param_groups[0]["lr"],
        "steps": done,
    }
    if strategy == "deepspeed":
        result["config"] = {
            key: model.config[key]
            for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
        }
        result["clipping"] = model.gradient_clipping()
        result["stage"] = model.zero_optimization_stage()
    result["params"] = _full_params(dist, model)
    return result


def _full_params(dist: Any, model: torch.nn.Module) -> list[list[float]]:
    import faccel

    inner = faccel.unwrap_model(model)
    if any(hasattr(p, "ds_id") for p in inner.parameters()):
        import deepspeed

        out = []
        for param in inner.parameters():
            with deepspeed.zero.GatheredParameters([param]):
                out.append(param.detach().flatten().tolist())
        return out
    return [p.detach().flatten().tolist() for p in inner.parameters()]
