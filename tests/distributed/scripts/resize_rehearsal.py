"""A multi-node rehearsal: train, checkpoint, and resume at another world size.

Run by tests/distributed/test_resize.py as two torchrun agents on one machine, each a "node"
of 2 processes meeting through a c10d rendezvous on localhost, then again as one agent of 3:

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint 127.0.0.1:PORT --node-rank N resize_rehearsal.py ROOT OUT first
    python -m torch.distributed.run --standalone --nproc-per-node 3 resize_rehearsal.py ROOT OUT resume

``first`` trains epoch 0 and three batches of epoch 1, then checkpoints into ROOT (which every
"node" sees: one machine's disk). ``resume`` restores at 3 ranks and finishes epoch 1. Each rank
writes the dataset indices of epoch 1 it read to ``OUT/<mode>-<rank>.json``, with the padding the
resumed loader reports and the node it ran on.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import attrs
import torch

import faccel

SAMPLES = 30


def main(root: str, out: str, mode: str) -> None:
    dist = faccel.detect(timeout=datetime.timedelta(seconds=30))
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.arange(SAMPLES),
        torch.randn(SAMPLES, 4, generator=generator),
        torch.randn(SAMPLES, 1, generator=generator),
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    loader = torch.utils.data.DataLoader(data, batch_size=2, shuffle=True)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
    state = faccel.TrainState.create(model=model, optimizer=optimizer, loader=loader)
    if mode == "resume":
        state = faccel.restore(dist, state, root)
    seen: list[int] = []
    while state.epoch < 2:
        view = loader.resume(state)
        for index, inputs, targets in view:
            if state.epoch == 1:
                seen += index.tolist()
            optimizer.zero_grad()
            faccel.backward(dist, torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            state = attrs.evolve(state, step=state.step + 1, position=state.position + 1)
            if mode == "first" and state.epoch == 1 and state.position == 3:
                faccel.checkpoint(dist, state, root)
                break
        else:
            state = attrs.evolve(state, epoch=state.epoch + 1, position=0)
            continue
        break
    report = {"seen": seen, "padding": view.padding, "world_size": dist.world_size, "node": dist.node_rank}
    (Path(out) / f"{mode}-{dist.rank}.json").write_text(json.dumps(report))
    faccel.shutdown(dist)


if __name__ == "__main__":
    main(*sys.argv[1:4])
