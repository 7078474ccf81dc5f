"""Worker functions for the data tests on real processes (importable by the harness)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    TensorDataset,
    WeightedRandomSampler,
)


class Buckets(Sampler[list[int]]):
    """Length-grouped batches: shuffled, sorted by length, batches shuffled (from its generator)."""

    def __init__(self, lengths: list[int], batch_size: int) -> None:
        self.lengths, self.batch_size, self.generator = lengths, batch_size, None

    def __iter__(self):
        order = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        order.sort(key=lambda i: self.lengths[i])
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        return iter([batches[i] for i in torch.randperm(len(batches), generator=self.generator).tolist()])

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)


class Items(Dataset):
    """Item i is a prebatched tensor of i % 3 + 1 copies of i (for batch_size=None)."""

    def __len__(self) -> int:
        return 7

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((i % 3 + 1,), i)


class Stream(IterableDataset):
    def __iter__(self):
        return iter(torch.arange(11))


class Noisy(Dataset):
    """An augmentation: each sample draws from the worker's global generators."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i), torch.rand(()).item()], dtype=torch.float64)


def forms_metrics(num_workers: int) -> dict[str, Any]:
    """Each loader form on real ranks: gather_for_metrics of tensors and strings, per batch and at the end."""
    import faccel

    dist = faccel.detect()
    workers: dict[str, Any] = {"num_workers": num_workers}
    if num_workers:
        workers["multiprocessing_context"] = "fork"
    data = TensorDataset(torch.arange(13))
    makers = {
        "weighted": lambda: DataLoader(
            data, batch_size=2, sampler=WeightedRandomSampler([1.0] * 13, 9), **workers
        ),
        "buckets": lambda: DataLoader(
            data, batch_sampler=Buckets([(5 * i) % 7 for i in range(13)], 3), **workers
        ),
        "items": lambda: DataLoader(Items(), batch_size=None, **workers),
        "stream": lambda: DataLoader(Stream(), batch_size=2, **workers),
        "split": lambda: DataLoader(data, batch_size=4, shuffle=True, **workers),
    }
    options = {"stream": {"even_batches": False}, "split": {"split_batches": True}}
    out: dict[str, Any] = {}
    for name, make in makers.items():
        loader = faccel.prepare(dist, make(), **options.get(name, {}))
        view = loader.at(epoch=1)
        per_batch, texts, seen, outputs, rows_indices = [], [], [], [], []
        for k, batch in enumerate(view):
            x = batch if isinstance(batch, torch.Tensor) else batch[0]
            seen.append(x.tolist())
            outputs.append(x)
            got, indices = faccel.gather_for_metrics(
                dist, {"x": x, "text": [f"#{int(v)}" for v in x]}, view, batch=k, with_indices=True
            )
            per_batch.extend(got["x"].tolist())
            texts.extend(got["text"])
            rows_indices.extend(indices.tolist())
        if name != "items":
            whole = faccel.gather_for_metrics(dist, [f"#{int(v)}" for v in torch.cat(outputs)], view)
        else:
            whole = None
        out[name] = {
            "seen": seen,
            "per_batch": per_batch,
            "texts": texts,
            "indices": rows_indices,
            "whole": whole,
            "order": loader.sharding.order(1).tolist() if name != "stream" else list(range(11)),
            "items_order": loader.sharding.order(1).tolist(),
        }
    return out


def worker_draws(mode: str) -> dict[str, Any]:
    """Random numbers drawn in 2 loader workers: straight epoch, and resumed at batch 3."""
    import faccel

    dist = faccel.detect()
    loader = faccel.prepare(
        dist,
        DataLoader(Noisy(), batch_size=2, shuffle=True, num_workers=2, multiprocessing_context="fork"),
        worker_seeds=mode,
    )
    straight = [b.tolist() for b in loader.at(epoch=1)]
    resumed = [b.tolist() for b in loader.at(epoch=1, start=3)]
    return {"straight": straight, "resumed": resumed}


def uneven_training(n: int, batch: int, steps_of_rank: list[int] | None = None) -> dict[str, Any]:
    """even_batches=False under DDP with uneven_inputs: each step's averaged gradient."""
    import faccel

    dist = faccel.detect()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g))
    model, loader = faccel.prepare(dist, model, DataLoader(data, batch_size=batch), even_batches=False)
    grads = []
    with faccel.uneven_inputs(dist, model):
        for x, y in loader:
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            grads.append([model.module.weight.grad.flatten().tolist(), model.module.bias.grad.tolist()])
    faccel.wait_for_everyone(dist)
    try:
        with faccel.uneven_inputs(dist, model.module):
            pass
    except faccel.errors.UsageError as error:
        refused = str(error)
    return {"grads": grads, "batches": len(loader), "refused": refused}


class OwnSeed(Sampler[int]):
    """Decides its order from its own seed and set_epoch (faccel cannot seed it)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(
            torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch)).tolist()
        )

    def __len__(self) -> int:
        return self.n


def disagreeing_sampler() -> dict[str, Any]:
    """A sampler built with another seed on each rank: prepare says so on every rank."""
    import faccel

    dist = faccel.detect()
    alike = faccel.prepare(
        dist, DataLoader(TensorDataset(torch.arange(8)), batch_size=2, sampler=OwnSeed(8, 3))
    )
    try:
        faccel.prepare(
            dist, DataLoader(TensorDataset(torch.arange(8)), batch_size=2, sampler=OwnSeed(8, dist.rank))
        )
    except faccel.errors.PrepareError as error:
        return {"error": str(error), "alike": [b.tolist() for (b,) in alike]}
    return {"error": None}
