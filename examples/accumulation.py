"""Gradient accumulation and mixed precision in the seed loop.

python examples/accumulation.py
FACCEL_PRECISION=bf16 torchrun --standalone --nproc-per-node 2 examples/accumulation.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel


def main(epochs: int = 3) -> None:
    dist = faccel.detect(accumulation_steps=4)
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 32, generator=generator)
    targets = inputs @ (torch.randn(32, 1, generator=generator) / 32**0.5)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.98**step)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=8, shuffle=True)
    model, optimizer, loader, scheduler = faccel.prepare(dist, model, optimizer, loader, scheduler)
    scaler = faccel.grad_scaler(dist)  # active only when FACCEL_PRECISION=fp16

    steps = skipped = 0
    for epoch in range(epochs):
        for micro, (x, y) in faccel.micro_batches(dist, loader.at(epoch=epoch)):
            with faccel.accumulate(dist, model, micro):
                loss = nn.functional.mse_loss(model(x), y)
                faccel.backward(dist, loss, micro=micro, scaler=scaler)
            if micro.sync:
                faccel.clip_grad_norm(dist, model, 1.0, scaler=scaler, optimizer=optimizer)
                stepped = faccel.optimizer_step(dist, optimizer, scaler=scaler, scheduler=scheduler)
                steps, skipped = steps + stepped, skipped + (not stepped)
                optimizer.zero_grad()
        if dist.is_main_process:
            print(f"epoch {epoch}: loss {loss.item():.4f}")
    if dist.is_main_process:
        print(
            f"precision {dist.precision}, world size {dist.world_size}: {steps} optimizer steps, "
            f"{skipped} skipped, {len(loader)} micro-batches per rank per epoch"
        )
    faccel.shutdown(dist)


if __name__ == "__main__":
    main()
