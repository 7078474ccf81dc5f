"""A mixture-of-experts model trained in a plain loop, in one process or with its experts split.

    python examples/moe_loop.py
    FACCEL_LAYOUT=expert=2 torchrun --nproc-per-node 2 examples/moe_loop.py

Both print the same losses (to float32 rounding: docs/parallelism.md, "Mixture of experts"). Under
``expert=2`` each rank holds 4 of the 8 experts of each layer and reads half of every global batch;
``prepare`` found the experts module (``Experts`` below meets faccel's contract, as transformers'
``MixtralExperts`` does) and gave it a forward that sends each token to its experts' ranks by
all-to-all and back. The loop is the same in both: nothing in it knows about experts, but the
load it prints.
"""

from __future__ import annotations

import torch
from torch import nn

import faccel

EXPERTS, TOP_K, HIDDEN, VOCAB = 8, 2, 32, 64


class Experts(nn.Module):
    """``EXPERTS`` two-layer MLPs, their weights stacked along dim 0 (the experts contract)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = EXPERTS
        self.up = nn.Parameter(torch.randn(EXPERTS, 2 * HIDDEN, HIDDEN) / HIDDEN**0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * HIDDEN) / (2 * HIDDEN) ** 0.5)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.num_experts):  # each expert's tokens, in (slot, token) order
            slot, token = torch.where(index.t() == expert)
            rows = torch.relu(hidden[token] @ self.up[expert].t()) @ self.down[expert].t()
            out = out.index_add(0, token, rows * weights[token, slot, None])
        return out


class MoeLayer(nn.Module):
    """A router (top-2 of a softmax) and its experts, with a residual connection."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.experts = Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x).reshape(-1, HIDDEN)
        weights, index = torch.topk(torch.softmax(self.gate(h), dim=-1), TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.experts(h, index, weights).view_as(x)


class TinyMoe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([MoeLayer(), MoeLayer()])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    dist = faccel.detect()
    torch.manual_seed(0)
    model = TinyMoe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.utils.data.TensorDataset(
        torch.randint(0, VOCAB, (64, 12), generator=torch.Generator().manual_seed(1))
    )
    # split_batches: the global batch is 8 sequences at any world size, each rank reading its share
    loader = torch.utils.data.DataLoader(data, batch_size=8)
    # experts=: the same dispatch in one process too (found by the search without it, under expert=2)
    experts = ["layers.0.experts", "layers.1.experts"]
    model, optimizer, loader = faccel.prepare(
        dist, model, optimizer, loader, split_batches=True, experts=experts
    )
    for epoch in range(3):
        total = torch.zeros(())
        for (tokens,) in loader:
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
            faccel.backward(dist, loss)
            optimizer.step()
            optimizer.zero_grad()
            total += faccel.reduce(dist, loss.detach(), "mean")
        load = faccel.expert_load(dist)  # the last step's, summed over the ranks
        routed = load["layers.0.experts"]["world_routed"] if load else []
        faccel.print(dist, f"epoch {epoch} tokens per expert {routed} loss {float(total) / len(loader):.6f}")
    faccel.shutdown(dist)


if __name__ == "__main__":
    main()
