"""A smaller twin of examples/run_clm.py's life cycle, to prove that every rank exits.

    torchrun --standalone --nproc-per-node 2 tests/distributed/scripts/exit_twin.py OUT

What run_clm does around its model, without transformers: a DDP model and AdamW with two
groups, a shuffled training loader and an evaluation loader prepared together, an epoch of
accumulated steps with clipping and a scheduler, an evaluation under ``no_grad`` gathered
with ``gather_for_metrics``, ``save_model``, ``shutdown``; then ``main`` returns the unwrapped
model, so the DDP wrapper is freed after the group is gone, as run_clm's is. Each rank writes
``exited-RANK`` as its very last act.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import faccel


class Tiny(torch.nn.Module):
    """An embedding, a block and a read-out: a language model's shape, small."""

    def __init__(self, vocab: int = 30, width: int = 16) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.block = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU())
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(self.embed(ids))))


def main(out: Path) -> dict[str, Any]:
    dist = faccel.detect(accumulation_steps=2, seed=7)
    faccel.set_seed(dist, 7)
    ids = torch.randint(0, 30, (96, 8), generator=torch.Generator().manual_seed(0))
    model = Tiny()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": rest}], lr=3e-3)
    train = DataLoader(TensorDataset(ids[:80]), batch_size=4, shuffle=True)
    evaluation = DataLoader(TensorDataset(ids[80:]), batch_size=4)
    model, optimizer, train, evaluation = faccel.prepare(dist, model, optimizer, train, evaluation)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
    model.train()
    for micro, (batch,) in faccel.micro_batches(dist, train):
        with faccel.accumulate(dist, model, micro):
            logits = model(batch[:, :-1])
            loss = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:])
            faccel.backward(dist, loss, micro=micro)
        if micro.sync:
            faccel.clip_grad_norm(dist, model, 1.0)
            faccel.optimizer_step(dist, optimizer, scheduler=scheduler)
            optimizer.zero_grad()
    model.eval()
    losses = []
    for k, (batch,) in enumerate(evaluation):
        with torch.no_grad():
            logits = model(batch[:, :-1])
        per_row = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
        losses.append(faccel.gather_for_metrics(dist, per_row.sum(dim=1), evaluation, batch=k))
    model.train()
    faccel.save_model(dist, model, out / "model")
    faccel.shutdown(dist)
    return {"rank": dist.rank, "loss": torch.cat(losses).mean().item(), "model": faccel.unwrap_model(model)}


if __name__ == "__main__":
    folder = Path(sys.argv[1])
    rank = main(folder)["rank"]  # the DDP wrapper is freed here, after shutdown, as in run_clm
    (folder / f"exited-{rank}").write_text(str(os.getpid()))
