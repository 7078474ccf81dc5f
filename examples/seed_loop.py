"""The seed training loop with faccel: one process, or `torchrun --nproc-per-node 2`.

python examples/seed_loop.py
torchrun --standalone --nproc-per-node 2 examples/seed_loop.py
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel


def main(epochs: int = 5) -> float:
    dist = faccel.detect()  # reads torchrun's variables; starts gloo/NCCL for > 1 process

    # Synthetic regression data, the same on every rank (a fixed seed).
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 32, generator=generator)
    weights = torch.randn(32, 1, generator=generator) / 32**0.5
    targets = inputs @ weights + 0.1 * torch.randn(512, 1, generator=generator)

    torch.manual_seed(0)  # identical initial weights on every rank
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.99**step)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True)
    loss_function = nn.MSELoss()

    model, optimizer, loader, scheduler = faccel.prepare(dist, model, optimizer, loader, scheduler)

    loss = torch.zeros(())
    for epoch in range(epochs):
        for batch in loader.at(epoch=epoch):  # a new shuffle each epoch
            optimizer.zero_grad()
            inputs, targets = batch
            loss = loss_function(model(inputs), targets)
            faccel.backward(dist, loss)
            optimizer.step()
            scheduler.step()
        if faccel.is_main_process(dist):
            print(f"epoch {epoch}: loss {loss.item():.4f}")

    if faccel.is_main_process(dist):
        print(
            f"world size {dist.world_size}, {len(loader)} batches per rank per epoch, "
            f"{scheduler.last_epoch} optimizer steps, final loss {loss.item():.4f}"
        )
    faccel.shutdown(dist)
    return loss.item()


if __name__ == "__main__":
    main()
