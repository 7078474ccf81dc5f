"""A small transformer trained on 4 processes in three layouts, each against one process.

python examples/parallel_transformer.py

The same script, the same global batch of 8 sequences, four ways:

* one process (the reference);
* ``shard=2,tensor=2``: FSDP2 over 2 data-parallel ranks, each layer split over 2;
* ``replicate=2,shard=2``: HSDP, two replicas each sharded over 2 ranks;
* ``tensor=4``: every layer split over all 4 ranks, one data-parallel rank.

Tensor parallelism comes from :data:`PLAN`, written in PyTorch's own terms
(``torch.distributed.tensor.parallel``): attention's q, k and v projections
split by output features (each rank computes a quarter or half of the heads),
its output projection by input features; the MLP's first linear by
columns, its second by rows. Each pair needs one all-reduce in the forward and
one in the backward. The printed losses agree with one process's to about
1e-6: the same sums, added in another order.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.utils.data import DataLoader, Dataset

import faccel

DIM, HEADS, DEPTH, SEQ = 16, 4, 2, 4
GLOBAL_BATCH = 8  # sequences per optimizer step, whatever the layout
SAMPLES = 2 * GLOBAL_BATCH  # two steps an epoch
LAYOUTS = ("shard=2,tensor=2", "replicate=2,shard=2", "tensor=4")

#: The tensor-parallel plan of :class:`TinyTransformer`: ``parallelize_module``'s dict.
#: Colwise splits a Linear's output features, Rowwise its input features and sums
#: the partial outputs; a Colwise -> Rowwise pair keeps the activation between them split.
PLAN: dict[str, Any] = {
    "blocks.*.attn.q": ColwiseParallel(),
    "blocks.*.attn.k": ColwiseParallel(),
    "blocks.*.attn.v": ColwiseParallel(),
    "blocks.*.attn.o": RowwiseParallel(),
    "blocks.*.mlp.up": ColwiseParallel(),
    "blocks.*.mlp.down": RowwiseParallel(),
}


class Attention(nn.Module):
    """Multi-head self-attention whose head count follows its (possibly split) projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        # -1 heads: under tensor parallelism q holds this rank's heads only.
        q, k, v = (f(x).view(b, n, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        return self.o((weights @ v).transpose(1, 2).reshape(b, n, -1))


class MLP(nn.Module):
    """Two linears with a GELU between them."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.gelu(self.up(x)))


class Block(nn.Module):
    """A pre-norm transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim), Attention(dim, heads)
        self.norm2, self.mlp = nn.LayerNorm(dim), MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """``DEPTH`` blocks and a linear read-out of one number per position."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(DIM, HEADS) for _ in range(DEPTH))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        # sum over the one feature rather than squeeze: FSDP2 warns about a view as output.
        return self.head(x).sum(-1)


class Sequences(Dataset):  # type: ignore[type-arg]
    """Random sequences and targets, each item with its index (to see who read what)."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, SEQ, DIM, generator=generator)
        self.y = self.x.sum(-1).tanh()

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def build(dist: faccel.DistState) -> tuple[faccel.TrainState, faccel.PreparedLoader]:
    """The run's objects at step 0: the same weights on every rank, batches of ``GLOBAL_BATCH`` in all."""
    torch.manual_seed(0)
    model = TinyTransformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    per_rank = GLOBAL_BATCH // (dist.data_world_size * dist.accumulation_steps)
    loader = DataLoader(Sequences(), batch_size=per_rank)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader, tp_plan=PLAN)
    return faccel.TrainState.create(model=model, optimizer=optimizer), loader


def train(
    dist: faccel.DistState, state: faccel.TrainState, loader: faccel.PreparedLoader, *, epochs: int
) -> tuple[faccel.TrainState, dict[str, list[Any]]]:
    """Train from ``state`` to the end of epoch ``epochs``; each step's loss, norm and indices read."""
    log: dict[str, list[Any]] = {"loss": [], "norm": [], "indices": [], "samples": []}
    for epoch in range(state.epoch, epochs):
        step_loss, indices = torch.zeros(()), []
        for micro, (x, y, index) in faccel.micro_batches(dist, loader.at(epoch=epoch)):
            with faccel.accumulate(dist, state.model, micro):
                loss = nn.functional.mse_loss(state.model(x), y)
                faccel.backward(dist, loss, micro=micro)
            step_loss, indices = step_loss + loss.detach() / micro.group_size, indices + index.tolist()
            if micro.sync:
                norm = faccel.clip_grad_norm(dist, state.model, 1.0)
                state.optimizer.step()
                state.optimizer.zero_grad()
                log["loss"].append(faccel.reduce(dist, step_loss).item())  # over data-parallel ranks
                log["samples"].append(int(faccel.reduce(dist, torch.tensor(len(indices)), op="sum")))
                log["norm"].append(norm.item())
                log["indices"].append(indices)
                step_loss, indices = torch.zeros(()), []
                state = attrs.evolve(state, step=state.step + 1)
        state = attrs.evolve(state, epoch=epoch + 1, position=0)
    return state, log


def predictions(
    dist: faccel.DistState, state: faccel.TrainState, loader: faccel.PreparedLoader
) -> list[float]:
    """The model's output for every sample, once each, in dataset order (``gather_for_metrics``)."""
    outputs = []
    with torch.no_grad():
        for x, _, _ in loader.at(epoch=0):
            outputs.append(state.model(x))
    return faccel.gather_for_metrics(dist, torch.cat(outputs), loader).flatten().tolist()


def run(layout: str | None = None, epochs: int = 2) -> dict[str, Any]:
    """One run in ``layout`` (None: one process): its log and final predictions."""
    dist = faccel.detect({} if layout is None else None, layout=layout)
    state, loader = build(dist)
    state, log = train(dist, state, loader, epochs=epochs)
    return {**log, "predictions": predictions(dist, state, loader)}


def main() -> None:
    reference = run(None)
    print(f"one process          losses {[f'{x:.6f}' for x in reference['loss']]}")
    for layout in LAYOUTS:
        got = faccel.launch(run, nprocs=4, kwargs={"layout": layout}, timeout=120)
        gap = max(abs(a - b) for a, b in zip(got["loss"], reference["loss"], strict=True))
        print(f"{layout:20} losses {[f'{x:.6f}' for x in got['loss']]}  largest gap {gap:.1e}")


if __name__ == "__main__":
    main()
