"""Loss by item count on real processes: variable-length sequences, accumulation, DDP and FSDP2."""

from __future__ import annotations

from typing import Any

import torch

VOCAB = 11


def sequence(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index``: tokens and next-token labels of a length from 1 to 6 (deterministic)."""
    length = 1 + (index * 7) % 6
    g = torch.Generator().manual_seed(1000 + index)
    tokens = torch.randint(0, VOCAB, (length + 1,), generator=g)
    return tokens[:-1], tokens[1:]


def padded(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch padded to its longest sequence; padded labels are -100 (ignored)."""
    pairs = [sequence(i) for i in indices]
    width = max(len(t) for t, _ in pairs)
    tokens = torch.zeros(len(pairs), width, dtype=torch.long)
    labels = torch.full((len(pairs), width), -100, dtype=torch.long)
    for row, (t, lab) in enumerate(pairs):
        tokens[row, : len(t)] = t
        labels[row, : len(lab)] = lab
    return tokens, labels


class TokenModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(2)
        )
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def token_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TokenModel()


def loss_sum(model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )


def items_of(batch: Any) -> int:
    return int((batch[1] != -100).sum())


def collate(rows: list[tuple[torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    return padded([int(row[0]) for row in rows])


def items_loop(strategy: str, samples: int, batch_size: int, accumulation_steps: int) -> dict[str, Any]:
    """Every group's gradients after its syncing backward, by token count; and the counts."""
    import faccel

    dist = faccel.detect(strategy=strategy, accumulation_steps=accumulation_steps)
    model = token_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: every group sees the same weights
    data = torch.utils.data.TensorDataset(torch.arange(samples))
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, collate_fn=collate)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
    grads, counts = [], []
    for micro, (tokens, labels) in faccel.micro_batches(dist, loader, items=items_of):
        with faccel.accumulate(dist, model, micro):
            n = int((labels != -100).sum())
            faccel.backward(dist, loss_sum(model, tokens, labels), micro=micro, items=n)
        if micro.sync:
            counts.append(micro.items)
            grads.append(
                [
                    (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten().tolist()
                    for p in model.parameters()
                ]
            )
            optimizer.step()
            optimizer.zero_grad()
    return {"grads": grads, "counts": counts}
