"""One training loop for every layout: your own model, cut into pipeline stages when the layout says so.

python examples/pipeline_loop.py                                   # one process
FACCEL_LAYOUT=pipeline=2 torchrun --nproc-per-node 2 examples/pipeline_loop.py

The loop never asks which layout runs: ``faccel.forward_backward`` is ``loss = loss_fn(model(x), y);
faccel.backward(dist, loss)`` in one process, and torch's 1F1B schedule over 4 micro-batches when the
layout has ``pipeline=2`` (``prepare`` cut the model where ``split`` names, ``layers.2``). Clipping
takes the norm over every stage; the loss comes back on every rank. Both runs print the same losses
to about 1e-6 (micro-batches add the same sums in another order).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel


class Net(nn.Module):
    """A plain model: an input layer, four blocks, a read-out."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def main() -> None:
    dist = faccel.detect()
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    # every step the same batch shape: a pipeline's stages keep the first batch's
    loader = DataLoader(data, batch_size=32, shuffle=True, drop_last=True)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = faccel.prepare(
        dist,
        model,
        optimizer,
        loader,
        split=("layers.2",),  # used only when the layout has pipeline stages
        schedule=faccel.Schedule(kind="1f1b", microbatches=4),
    )
    for epoch in range(3):
        total = 0.0
        for inputs, targets in loader.at(epoch=epoch):
            optimizer.zero_grad()
            loss = faccel.forward_backward(dist, model, nn.functional.mse_loss, inputs, targets)
            faccel.clip_grad_norm(dist, model, 1.0)
            faccel.optimizer_step(dist, optimizer)
            total += float(loss)
        faccel.print(dist, f"epoch {epoch}: mean loss {total / len(loader):.6f}")
    faccel.shutdown(dist)


if __name__ == "__main__":
    main()
