"""What the exact-mode tests run on every rank: examples/exact_any_scale.py's own loop, and the refusals."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "exact_any_scale.py"


def example() -> Any:
    """examples/exact_any_scale.py as a module (examples/ is not a package)."""
    name = "exact_any_scale_example"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, EXAMPLE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def train(**kwargs: Any) -> dict[str, Any]:
    return example().train(**kwargs)  # type: ignore[no-any-return]


def refusals() -> dict[str, str]:
    """Unequal thread counts, then a backward outside ``accumulate``: each refused on every rank."""
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import faccel

    dist = faccel.detect()
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    data = TensorDataset(torch.randn(16, 4))
    model, loader = faccel.prepare(dist, model, DataLoader(data, batch_size=4))
    out = {}
    torch.set_num_threads(1 + dist.rank)
    try:
        next(faccel.micro_batches(dist, loader, atoms=4, model=model))
    except faccel.errors.UsageError as error:
        out["threads"] = str(error)
    torch.set_num_threads(1)
    for micro, (x,) in faccel.micro_batches(dist, loader, atoms=4, model=model):
        try:
            faccel.backward(dist, model(x).sum(), micro=micro)  # no `with faccel.accumulate(...)`
        except faccel.errors.UsageError as error:
            out["no_sync"] = str(error)
        break
    return out


def nodes(world: int) -> list[list[Any]]:
    """Each rank's buffers for the chunked exchange: odd lengths, one under ``world``, a float64 slot."""
    import torch

    out = []
    for rank in range(world):
        generator = torch.Generator().manual_seed(rank)
        out.append(
            [
                torch.randn(37, generator=generator) * torch.logspace(-6, 6, 37),
                torch.randn(world - 1, generator=generator),
                torch.randn(1, generator=generator, dtype=torch.float64),
            ]
        )
    return out


def chunked_exchange() -> list[list[int]]:
    """``exchange`` over gloo, every piece cut in chunks of 3 elements: each buffer's bytes after it."""
    import torch

    import faccel
    from faccel._loop._tree_reduce import exchange

    dist = faccel.detect()
    buffers = nodes(dist.world_size)[dist.rank]
    exchange(buffers, dist.rank, dist.world_size, chunk=3)
    faccel.shutdown(dist)
    return [b.view(torch.uint8).tolist() for b in buffers]
