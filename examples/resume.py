"""Stop mid-epoch, resume in a new process, and end with the very weights of a run that never stopped.

python examples/resume.py

The script trains without stopping, then trains the same run again and stops
mid-epoch after a checkpoint (as if the job had been preempted). A new process
restores the checkpoint, trains to the end and saves the weights, which the
script compares with the uninterrupted run's, bit for bit. The run uses
dropout, random input noise, shuffling and an LR schedule, so every piece of
the checkpoint (weights, AdamW state, schedule, generators, data position)
has to come back exactly.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import faccel

EPOCHS = 3
STOP_AT = 13  # 8 batches an epoch: step 13 is batch 5 of epoch 1


def build(dist: faccel.DistState) -> tuple[faccel.TrainState, faccel.PreparedLoader]:
    """The run's objects at step 0, identical in every process."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 16, generator=generator)
    targets = inputs @ torch.randn(16, 1, generator=generator) + 0.1 * torch.randn(
        256, 1, generator=generator
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=32, shuffle=True)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
    # Sized after prepare, in this process's optimizer steps (8 an epoch in one process).
    total_steps = EPOCHS * faccel.steps_per_epoch(dist, loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=2e-2, total_steps=total_steps)
    state = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler)
    return state, loader


def train(
    dist: faccel.DistState,
    state: faccel.TrainState,
    loader: faccel.PreparedLoader,
    *,
    root: Path | None = None,
    stop_at: int | None = None,
) -> faccel.TrainState:
    """The training loop, resumable: it starts wherever ``state`` says."""
    for epoch in range(state.epoch, EPOCHS):
        # A resumed epoch starts at the saved position; later ones at batch 0.
        state = attrs.evolve(state, epoch=epoch, position=state.position if epoch == state.epoch else 0)
        for inputs, targets in loader.at(epoch=epoch, start=state.position):
            state.optimizer.zero_grad()
            noisy = inputs + 0.05 * torch.randn_like(inputs)  # augmentation: uses the torch generator
            loss = nn.functional.mse_loss(state.model(noisy), targets)
            faccel.backward(dist, loss)
            state.optimizer.step()
            state.scheduler.step()
            state = attrs.evolve(state, step=state.step + 1, position=state.position + 1)
            if state.step == stop_at and root is not None:
                faccel.checkpoint(dist, state, root, keep=2)
                return state  # "preempted": stop before fetching another batch
    return attrs.evolve(state, epoch=EPOCHS, position=0)


def first_half(dist: faccel.DistState, root: Path) -> None:
    state, loader = build(dist)
    torch.manual_seed(1)  # the run's generator for dropout and noise
    state = train(dist, state, loader, root=root, stop_at=STOP_AT)
    print(f"stopped at step {state.step} (epoch {state.epoch}, batch {state.position}) and checkpointed")


def second_half(root: Path, out: Path) -> None:
    dist = faccel.detect()
    state, loader = build(dist)
    torch.manual_seed(12345)  # a new process: its generators start elsewhere, restore resets them
    state = faccel.restore(dist, state, root)
    print(
        f"restored {faccel.latest_checkpoint(root).name}: step {state.step}, epoch {state.epoch}, "
        f"batch {state.position}"
    )
    state = train(dist, state, loader)
    faccel.save_model(dist, state.model, out)


def main() -> bool:
    dist = faccel.detect()
    state, loader = build(dist)
    torch.manual_seed(1)
    uninterrupted = train(dist, state, loader)
    with tempfile.TemporaryDirectory() as folder:
        root, out = Path(folder) / "checkpoints", Path(folder) / "final"
        first_half(dist, root)
        script = str(Path(__file__).resolve())
        done = subprocess.run(
            [sys.executable, script, "--second-half", str(root), str(out)], capture_output=True, text=True
        )
        print("new process:", done.stdout.strip())
        if done.returncode != 0:
            print(done.stderr)
            return False
        resumed, _ = build(dist)
        faccel.load_model(dist, resumed.model, out)
    ours = faccel.unwrap_model(uninterrupted.model).state_dict()
    theirs = faccel.unwrap_model(resumed.model).state_dict()
    equal = all(
        torch.equal(ours[name].view(-1).view(torch.uint8), theirs[name].view(-1).view(torch.uint8))
        for name in ours
    )
    print(f"final weights equal an uninterrupted run's (bitwise, {len(ours)} tensors): {equal}")
    return equal


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--second-half",
        type=Path,
        nargs=2,
        metavar=("ROOT", "OUT"),
        help="restore from ROOT, finish, and save the weights to OUT",
    )
    arguments = parser.parse_args()
    if arguments.second_half:
        second_half(*arguments.second_half)
    else:
        sys.exit(0 if main() else 1)
