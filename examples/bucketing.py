"""Variable-length text with a length-grouped (bucketing) batch sampler: one process, or 2 with torchrun.

python examples/bucketing.py
torchrun --standalone --nproc-per-node 2 examples/bucketing.py

Sequences of similar length are batched together so little padding is computed;
`faccel.prepare` deals the sampler's batches whole to the ranks, draws them from
(dist.seed, epoch) on every rank alike, and `faccel.gather_for_metrics` returns
each evaluated sequence exactly once, with its text.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

import faccel


class Sentences(Dataset):
    """Token sequences of 3 to 24 tokens; the target is whether the sum of the tokens is even."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, 25, (n,), generator=g).tolist()
        self.tokens = [torch.randint(1, 50, (length,), generator=g) for length in lengths]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.tokens[i], int(self.tokens[i].sum()) % 2


class LengthGrouped(Sampler[list[int]]):
    """Shuffle, sort chunks of 8 batches by length, cut into batches, shuffle the batches.

    Its randomness comes from `self.generator`, which faccel reseeds from
    (dist.seed, epoch) for each epoch: every rank draws the same batches.
    """

    def __init__(self, lengths: list[int], batch_size: int) -> None:
        self.lengths, self.batch_size, self.generator = lengths, batch_size, None

    def __iter__(self):
        order = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        chunk = 8 * self.batch_size
        batches = []
        for i in range(0, len(order), chunk):
            ranked = sorted(order[i : i + chunk], key=lambda j: self.lengths[j])
            batches += [ranked[k : k + self.batch_size] for k in range(0, len(ranked), self.batch_size)]
        return iter([batches[i] for i in torch.randperm(len(batches), generator=self.generator).tolist()])

    def __len__(self) -> int:
        chunk = 8 * self.batch_size
        n = len(self.lengths)
        return sum(-(-min(chunk, n - i) // self.batch_size) for i in range(0, n, chunk))


def pad(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = nn.utils.rnn.pad_sequence([t for t, _ in batch], batch_first=True)
    return tokens, torch.tensor([label for _, label in batch])


def main(epochs: int = 2) -> dict[str, float]:
    dist = faccel.detect()
    data = Sentences(300)
    lengths = [len(t) for t in data.tokens]
    torch.manual_seed(0)
    model = nn.Sequential(nn.EmbeddingBag(50, 16, padding_idx=0), nn.Linear(16, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    train = DataLoader(data, batch_sampler=LengthGrouped(lengths, 16), collate_fn=pad)
    evaluate = DataLoader(data, batch_sampler=LengthGrouped(lengths, 32), collate_fn=pad)
    model, optimizer, train, evaluate = faccel.prepare(dist, model, optimizer, train, evaluate)
    pad_share = 0.0
    for epoch in range(epochs):
        padded = real = 0
        for tokens, labels in train.at(epoch=epoch):
            loss = nn.functional.cross_entropy(model(tokens), labels)
            optimizer.zero_grad()
            faccel.backward(dist, loss)
            optimizer.step()
            padded, real = padded + tokens.numel(), real + int((tokens != 0).sum())
        pad_share = 1 - real / padded
    # Evaluation: every sequence once, with a text column, whatever the world size.
    rows, texts = [], []
    with torch.no_grad():
        for k, (tokens, labels) in enumerate(evaluate):
            right = (model(tokens).argmax(1) == labels).long()
            text = [" ".join(map(str, t[t != 0].tolist()[:3])) for t in tokens]
            got = faccel.gather_for_metrics(dist, {"right": right, "text": text}, evaluate, batch=k)
            rows.append(got["right"])
            texts += got["text"]
    accuracy = float(torch.cat(rows).float().mean())
    result = {"evaluated": len(texts), "accuracy": accuracy, "padding_share": pad_share}
    faccel.print(dist, f"{len(texts)} sequences evaluated, accuracy {accuracy:.2f}, padding {pad_share:.1%}")
    return result


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
