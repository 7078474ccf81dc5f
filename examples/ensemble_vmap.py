"""An ensemble of models trained at once: vmap over stacked parameters.

python examples/ensemble_vmap.py
torchrun --standalone --nproc-per-node 2 examples/ensemble_vmap.py

``torch.func.stack_module_state`` stacks the parameters of K models of one
architecture along a new first dimension; ``torch.func.vmap`` over
``faccel.func.loss_and_grad(..., engine="func")`` computes the K losses and
gradients in one batched call; SGD and AdamW are elementwise, so the pure
optimizer updates the stacked tensors directly. With several processes the
stacked gradients are averaged like any other with ``faccel.func.sync_grads``.
"""

from __future__ import annotations

import logging
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))


def main(members: int = 8, epochs: int = 5) -> list[float]:
    dist = faccel.detect()
    log = faccel.get_logger(dist, __name__)

    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 32, generator=generator)
    weights = torch.randn(32, 1, generator=generator) / 32**0.5
    targets = inputs @ weights + 0.1 * torch.randn(512, 1, generator=generator)
    loader = faccel.prepare(dist, DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True))

    # K differently initialised models, the same on every rank; their tensors stacked.
    models = [make_model(seed) for seed in range(members)]
    params, buffers = torch.func.stack_module_state(models)
    params = {name: p.detach() for name, p in params.items()}  # the state owns plain tensors
    state = faccel.func.FunctionalState.create(
        params=params, buffers=buffers, optimizer=faccel.func.adamw(lr=1e-3)
    )

    # One model is the template that functional_call runs with each member's tensors.
    grad_fn = faccel.func.loss_and_grad(dist, make_model(0), nn.functional.mse_loss, engine="func")
    ensemble_grad_fn = torch.func.vmap(grad_fn, in_dims=(0, 0, None, None))  # members share batches

    losses = torch.zeros(members)
    for epoch in range(epochs):
        for batch_inputs, batch_targets in loader.at(epoch=epoch):
            losses, grads = ensemble_grad_fn(state.params, state.buffers, batch_inputs, batch_targets)
            state = state.apply_gradients(faccel.func.sync_grads(dist, grads))
        log.info("epoch %d: member losses %s", epoch, " ".join(f"{x:.3f}" for x in losses.tolist()))

    # The ensemble's prediction: the members' mean, in one vmapped forward.
    template = make_model(0)

    def predict(p: dict, b: dict, x: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(template, (p, b), (x,))

    predictions = torch.func.vmap(predict, in_dims=(0, 0, None))(state.params, state.buffers, inputs)
    ensemble_loss = nn.functional.mse_loss(predictions.mean(0), targets).item()
    log.info(
        "world size %d, %d members, %d steps; best member %.4f, ensemble of all %.4f (full data)",
        dist.world_size,
        members,
        state.step,
        min(losses.tolist()),
        ensemble_loss,
    )
    faccel.shutdown(dist)
    return losses.tolist()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    main()
