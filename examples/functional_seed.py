"""The seed task trained functionally (torch.func style): one process, or two with torchrun.

python examples/functional_seed.py
torchrun --standalone --nproc-per-node 2 examples/functional_seed.py

Same data, model, learning rate and schedule as examples/seed_loop.py, and the
same result: parameters live in a frozen ``FunctionalState``, gradients come
from a pure function, ``sync_grads`` averages them across ranks in reused flat
buffers (DDP's hooks do not run for functional code), and a pure SGD returns the
next state.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel


def make_task() -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, the same on every rank (a fixed seed)."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 32, generator=generator)
    weights = torch.randn(32, 1, generator=generator) / 32**0.5
    return inputs, inputs @ weights + 0.1 * torch.randn(512, 1, generator=generator)


def make_model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def learning_rate(step: int) -> float:
    """seed_loop's SGD(lr=0.1) with LambdaLR(lambda step: 0.99**step), as a value of the step."""
    return 0.1 * 0.99**step


def train(dist: faccel.DistState, epochs: int) -> tuple[float, faccel.func.FunctionalState]:
    """Train for ``epochs``; returns this rank's last loss and the final state."""
    log = faccel.get_logger(dist, __name__)
    inputs, targets = make_task()
    loader = faccel.prepare(dist, DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True))
    model = faccel.prepare(dist, make_model())  # under torchrun: DDP gives every rank rank 0's weights

    # Functional code bypasses DDP's gradient hooks: promise to sync, then do it below.
    params, buffers = faccel.func.model_params(dist, model, will_sync_grads=True)
    # The DDP wrapper has done its job and functional code never calls it; drop it now
    # rather than keep it alive past faccel.shutdown().
    model = faccel.unwrap_model(model)
    state = faccel.func.FunctionalState.create(params=params, buffers=buffers, optimizer=faccel.func.sgd(0.1))
    grad_fn = faccel.func.loss_and_grad(dist, model, nn.functional.mse_loss)
    # Flat buffers sync_grads reuses every step (nothing is allocated with one process). Each
    # step's averaged gradients are views of them: apply_gradients uses them before the next
    # sync_grads overwrites them.
    buckets = faccel.func.grad_buckets(dist, params)

    loss = torch.zeros(())
    for epoch in range(epochs):
        for batch_inputs, batch_targets in loader.at(epoch=epoch):
            loss, grads = grad_fn(state.params, state.buffers, batch_inputs, batch_targets)
            grads = faccel.func.sync_grads(
                dist, grads, buckets=buckets
            )  # the average over ranks, as DDP would
            state = state.apply_gradients(grads, lr=learning_rate(state.step))
        log.info("epoch %d: loss %.4f", epoch, loss.item())
    log.info(
        "world size %d, %d batches per rank per epoch, %d optimizer steps, final loss %.4f",
        dist.world_size,
        len(loader),
        state.step,
        loss.item(),
    )
    return loss.item(), state


def main(epochs: int = 5) -> float:
    dist = faccel.detect()  # reads torchrun's variables; starts gloo/NCCL for > 1 process
    loss, _ = train(dist, epochs)
    faccel.shutdown(dist)
    return loss


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main()
