"""Experiment tracking: a tracker made once, metrics logged each step, a plot of the run.

python examples/tracking.py RUN_DIR
torchrun --standalone --nproc-per-node 2 examples/tracking.py RUN_DIR

Writes RUN_DIR/config.json, RUN_DIR/metrics.jsonl (loss averaged over the ranks, the learning
rate and throughput, each record saying whose values it holds) and, with matplotlib installed,
RUN_DIR/metrics.png.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel


def main(run_dir: str, epochs: int = 3) -> None:
    dist = faccel.detect()
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(512, 32, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True) / 32**0.5
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
    total = epochs * faccel.steps_per_epoch(dist, loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=total)

    config = {"lr": 0.1, "epochs": epochs, "batch_size": 32, "world_size": dist.world_size}
    tracker = faccel.init_tracker(dist, run_dir, config=config)  # writes on the main process
    step = 0
    for epoch in range(epochs):
        for inputs_batch, targets_batch in loader.at(epoch=epoch):
            started = time.perf_counter()
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(model(inputs_batch), targets_batch)
            faccel.backward(dist, loss)
            optimizer.step()
            scheduler.step()
            step += 1
            seconds = time.perf_counter() - started
            # The loss averaged over the ranks (every rank calls log: a collective) ...
            faccel.log(dist, tracker, step, {"loss": loss.detach()}, reduce="mean")
            # ... and the main process's own learning rate and throughput.
            samples = len(inputs_batch) / seconds
            faccel.log(dist, tracker, step, {"lr": scheduler.get_last_lr()[0], "samples/s": samples})
    faccel.shutdown(dist, trackers=[tracker])  # closes the tracker, then the process group
    if dist.is_main_process:
        import subprocess

        # The same as typing `python -m faccel plot RUN_DIR` (it needs matplotlib).
        subprocess.run([sys.executable, "-m", "faccel", "plot", run_dir], check=False)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tracking")
