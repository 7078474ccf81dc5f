"""The seed training loop with faccel: one process, or `torchrun --nproc-per-node 2`.

python examples/seed_loop.py
torchrun --standalone --nproc-per-node 2 examples/seed_loop.py
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel


def main(epochs: int = 5) -> float:
    dist = faccel.detect()  # reads torchrun's variables; starts gloo/NCCL for > 1 process
    log = faccel.get_logger(dist, __name__)  # "[rank 0/2] ...", on the main process only

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
        # A new shuffle each epoch; the bar is drawn on the main process only.
        for batch in faccel.progress(dist, loader.at(epoch=epoch), desc=f"epoch {epoch}", leave=False):
            optimizer.zero_grad()
            inputs, targets = batch
            loss = loss_function(model(inputs), targets)
            faccel.backward(dist, loss)
            optimizer.step()
            scheduler.step()
        log.info("epoch %d: loss %.4f", epoch, loss.item())

    log.info(
        "world size %d, %d batches per rank per epoch, %d optimizer steps, final loss %.4f",
        dist.world_size,
        len(loader),
        scheduler.last_epoch,
        loss.item(),
    )
    faccel.shutdown(dist)
    return loss.item()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main()
