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
    from faccel._loop._exact._tree_reduce import exchange

    dist = faccel.detect()
    buffers = nodes(dist.world_size)[dist.rank]
    exchange(buffers, dist.rank, dist.world_size, chunk=3)
    faccel.shutdown(dist)
    return [b.view(torch.uint8).tolist() for b in buffers]


def overlapped_and_serial(bucket: int) -> dict[str, Any]:
    """Exact steps with each bucket's exchange started in the last backward, then without: the digests.

    Buckets of ``bucket`` elements (tiny, so a tiny model has several); a float64 parameter makes a
    second flat buffer; one parameter no forward uses stays out of every backward.
    """
    import hashlib

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import faccel
    from faccel._loop._exact import _mode as _exact

    _exact.BUCKET = bucket  # this process only

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(0.1))
            self.head = nn.Linear(16, 4)
            self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 4, dtype=torch.float64))
            self.unused = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (self.head(self.body(x)).double() * self.scale).float()

    torch.set_num_threads(1)
    dist = faccel.detect()
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=generator), torch.randn(96, 4, generator=generator))
    out: dict[str, Any] = {}
    for name, overlap in (("overlapped", True), ("serial", False)):
        torch.manual_seed(0)
        net = Net()
        model, optimizer, loader = faccel.prepare(
            dist,
            net,
            torch.optim.AdamW(net.parameters(), lr=1e-2),
            DataLoader(data, batch_size=32 // dist.world_size, drop_last=True),
        )
        early = []
        for micro, (x, y) in faccel.micro_batches(dist, loader, atoms=8, model=model):
            pool = dist.runtime.exact[model]
            pool.overlap = pool.overlap and overlap
            with faccel.accumulate(dist, model, micro):
                faccel.backward(dist, torch.nn.functional.mse_loss(model(x), y), micro=micro)
            if micro.sync:
                early.append(pool.started_early if pool.overlap else 0)
                faccel.optimizer_step(dist, optimizer)
                optimizer.zero_grad()
        digest = hashlib.sha256()
        for tensor in net.parameters():
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
        out[name] = digest.hexdigest()
        out[f"{name} early"] = early
        out[f"{name} buckets"] = len(_exact._layout(list(net.parameters()), bucket).spans)
    # The last model's hooks (faccel._marks.EXACT_BUCKET_READY), before and after shutdown.
    out["hooks"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in net.parameters())
    faccel.shutdown(dist)
    out["hooks after shutdown"] = sum(len(p._post_accumulate_grad_hooks or {}) for p in net.parameters())
    return out
