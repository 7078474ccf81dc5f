"""Workers for tests/test_context_cuda.py: context parallelism on CUDA GPUs over NCCL (never on the CPU)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class CausalLM(nn.Module):
    """One causal attention block over learned positions: what context parallelism splits."""

    def __init__(self, vocab: int = 32, width: int = 32, length: int = 64) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(length, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids) + self.positions(positions)
        q, k, v = (t.unsqueeze(1) for t in self.qkv(h).chunk(3, dim=-1))  # one head
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).squeeze(1)
        return self.out(h + attended)


def batch(length: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 32, (2, length + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]  # the labels shifted over the whole sequence


def one_step(dist: Any, model: nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> dict[str, Any]:
    """One step: the mean token loss, and each parameter's gradient (whole, as lists)."""
    import faccel

    layout = dist.parallel
    rank, ranks = layout.coordinate("context", dist.rank), layout.context
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    part = faccel.context_shard(
        {"ids": ids, "labels": labels, "positions": positions}, rank=rank, ranks=ranks
    )
    part = faccel.to_device(part, dist.device)
    with faccel.context_attention(dist):
        logits = model(part["ids"], part["positions"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), part["labels"].flatten())
        faccel.backward(dist, loss)
    total = faccel.reduce(dist, loss.detach(), op="mean")
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        grads[name] = grad.float().cpu().flatten()[:64].tolist()
    return {"loss": float(total), "grads": grads}


def context_step() -> dict[str, Any]:
    """One step on context=2 (2 GPUs): the sequence sliced head-tail, ring attention by torch."""
    import faccel

    dist = faccel.detect(layout=f"context={torch.cuda.device_count()}")
    torch.manual_seed(0)
    model = faccel.prepare(dist, CausalLM())
    ids, labels = batch()
    return one_step(dist, model, ids, labels)


def reference_step() -> dict[str, Any]:
    """The same step in one process on one GPU, on the whole sequence."""
    import faccel

    dist = faccel.detect({})
    torch.manual_seed(0)
    model = faccel.prepare(dist, CausalLM())
    ids, labels = batch()
    return one_step(dist, model, ids, labels)
