"""Models the meta path must get right or refuse (tests/test_materialize.py), and their 2-rank workers.

Integer, bool and complex buffers (computed, left unset, half written), tied weights in both
registration orders and both tie directions, a tie across two FSDP2 units, a model with buffers and
no parameters, a buffer two modules share.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import faccel
from faccel.errors import FaccelError

DTYPES = {"int64": torch.int64, "int32": torch.int32, "uint8": torch.uint8, "bool": torch.bool}
DTYPES["complex64"] = torch.complex64


def table(dtype: torch.dtype) -> torch.Tensor:
    """A 4 x 4 table of ``dtype`` the constructor computes: positions, a causal mask, rotations."""
    if dtype == torch.bool:
        return torch.ones(4, 4, dtype=torch.bool).tril()
    if dtype.is_complex:
        return torch.polar(torch.ones(4, 4), torch.arange(16.0).reshape(4, 4)).to(dtype)
    return torch.arange(16).reshape(4, 4).to(dtype)


class Tables(nn.Module):
    """A weight and a buffer of ``dtype``; ``reset_parameters`` fills the buffer whole, half or not."""

    def __init__(self, dtype: torch.dtype = torch.int64, fill: str = "whole") -> None:
        super().__init__()
        self.fill = fill
        self.weight = nn.Parameter(torch.empty(4))
        self.register_buffer("table", table(dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.normal_(self.weight)
            if self.fill == "whole":
                self.table.copy_(table(self.table.dtype))
            elif self.fill == "half":
                self.table[:2].copy_(table(self.table.dtype)[:2])


class Computed(nn.Module):
    """Every non-float kind the meta path must compute exactly: a bool mask, int64 positions, complex
    rotations (their module's reset_parameters computes them), and BatchNorm's int64 counter."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.tables = nn.ModuleList(Tables(DTYPES[name]) for name in sorted(DTYPES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x))


class HeadFirst(nn.Module):
    """The head registered before the embedding, tied from the embedding: the eager build keeps the
    embedding's draw. Undeclared: the built model cannot say which way it was tied."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 11, bias=False)
        self.embed = nn.Embedding(11, 8)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class DeclaredHeadFirst(HeadFirst):
    _tied_weights_keys = {"head.weight": "embed.weight"}  # noqa: RUF012  # tied name -> tied from


class DeclaredEmbedFirst(nn.Module):
    _tied_weights_keys = {"head.weight": "embed.weight"}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class DeclaredReverse(nn.Module):
    """The head first and the embedding tied *from the head*: the eager build keeps the head's draw."""

    _tied_weights_keys = {"embed.weight": "head.weight"}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(8, 11, bias=False)
        self.embed = nn.Embedding(11, 8)
        self.embed.weight = self.head.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens))


class Flat(nn.Module):
    """A tied embedding and head with no block list: FSDP2's default policy makes each child a unit."""

    _tied_weights_keys = {"head.weight": "embed.weight"}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(tokens)))


class Noise(nn.Module):
    """A random float buffer drawn by reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("noise", torch.empty(5))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.noise.normal_()


class Positions(nn.Module):
    """An int64 and a bool table, computed by reset_parameters; no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", table(torch.int64))
        self.register_buffer("mask", table(torch.bool), persistent=False)

    def reset_parameters(self) -> None:
        self.table.copy_(table(torch.int64))
        self.mask.copy_(table(torch.bool))


class BuffersOnly(nn.Module):
    """No parameters: a float, an int64 and a bool table, and a random buffer shared by two modules."""

    _tied_weights_keys = {"b.noise": "a.noise"}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.positions = Positions()
        self.a = Noise()
        self.b = Noise()
        self.b.noise = self.a.noise  # shared: one tensor, a's draw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.a.noise.sum() + self.positions.table.sum()


class SharedBuffer(nn.Module):
    """A random buffer two modules share, and a layer to train (for DDP)."""

    _tied_weights_keys = {"b.noise": "a.noise"}  # noqa: RUF012

    def __init__(self) -> None:
        super().__init__()
        self.a = Noise()
        self.proj = nn.Linear(5, 5)
        self.b = Noise()
        self.b.noise = self.a.noise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x + self.a.noise)


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def eager(build: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return build()


def whole(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors of a prepared model's parameters and buffers by name, every owner's name kept."""
    inner = faccel.unwrap_model(model)
    out = {}
    named = [*inner.named_parameters(remove_duplicate=False), *inner.named_buffers(remove_duplicate=False)]
    for name, tensor in named:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach().cpu()
    return out


def bits(tensor: torch.Tensor) -> list[int]:
    """The bytes of a tensor (JSON-able, bitwise comparable, any dtype)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8).tolist()


def same_as_eager(dist: Any, build: Callable[[], nn.Module], **options: Any) -> dict[str, Any]:
    """Prepare the eager build and the meta build of ``build``; which tensors match bitwise."""
    want = whole(eager(build))
    torch.manual_seed(0)
    model = faccel.prepare(dist, on_meta(build), **options)
    got = whole(model)
    return {
        "names": sorted(want),
        "equal": sorted(n for n in want if n in got and bits(want[n]) == bits(got[n])),
        "model": model,
    }


def refusal(call: Callable[[], Any]) -> str:
    """The named error ``call`` raises (its class and message), or ``'no error'``."""
    try:
        call()
    except FaccelError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def holes_run(*, strategy: str) -> dict[str, Any]:
    """On 2 gloo ranks: each hole of the meta path, refused by name or exact (the results as JSON)."""
    dist = faccel.detect(strategy=strategy)
    out: dict[str, Any] = {}
    # 2: a table of each non-float dtype its reset_parameters leaves unset, or half written
    for name in sorted(DTYPES):
        out[f"unset_{name}"] = refusal(
            lambda n=name: faccel.prepare(dist, on_meta(lambda: Tables(DTYPES[n], "none")))
        )
    out["half_int64"] = refusal(lambda: faccel.prepare(dist, on_meta(lambda: Tables(torch.int64, "half"))))
    computed = same_as_eager(dist, Computed)
    out["computed"] = [computed["names"], computed["equal"]]
    # 3: ties in both registration orders and both directions
    for build in (DeclaredHeadFirst, DeclaredEmbedFirst, DeclaredReverse):
        result = same_as_eager(dist, build)
        inner = faccel.unwrap_model(result["model"])
        out[build.__name__] = [result["names"], result["equal"], inner.head.weight is inner.embed.weight]
    out["undeclared"] = refusal(lambda: faccel.prepare(dist, on_meta(HeadFirst)))
    # 4: a tie across two units of the default policy, meta and eager; a policy that splits it
    flat = same_as_eager(dist, Flat)
    inner = faccel.unwrap_model(flat["model"])
    eager_flat = faccel.prepare(dist, eager(Flat))
    tokens = torch.arange(6).reshape(1, 6) % 11
    loss = flat["model"](tokens).square().mean()
    faccel.backward(dist, loss)
    out["flat"] = {
        "names": flat["names"],
        "equal": flat["equal"],
        "tied": inner.head.weight is inner.embed.weight,
        "eager_equal": sorted(
            n for n, t in whole(eager_flat).items() if bits(t) == bits(whole(eager(Flat))[n])
        ),
        "eager_tied": faccel.unwrap_model(eager_flat).head.weight
        is faccel.unwrap_model(eager_flat).embed.weight,
        "loss": loss.item(),
    }
    split = {"shard_policy": lambda m: isinstance(m, nn.Embedding | nn.Linear)}
    out["split_meta"] = refusal(lambda: faccel.prepare(dist, on_meta(Flat), **split))
    out["split_eager"] = refusal(lambda: faccel.prepare(dist, eager(Flat), **split))
    # 5: buffers and no parameters; a buffer two modules share
    if strategy == "ddp":
        out["buffers_only"] = refusal(lambda: faccel.prepare(dist, on_meta(BuffersOnly)))
    else:
        result = same_as_eager(dist, BuffersOnly)
        inner = faccel.unwrap_model(result["model"])
        out["buffers_only"] = [result["names"], result["equal"], inner.a.noise is inner.b.noise]
    shared = same_as_eager(dist, SharedBuffer)
    inner = faccel.unwrap_model(shared["model"])
    out["shared_buffer"] = [shared["names"], shared["equal"], inner.a.noise is inner.b.noise]
    return out


def tp_tie_run() -> dict[str, Any]:
    """Under tensor parallelism (tensor=2): a plan that splits a tied head is refused by name, meta and
    eager; a plan that leaves the tie alone is bitwise the eager build, still tied."""
    from torch.distributed.tensor.parallel import ColwiseParallel

    dist = faccel.detect(layout="tensor=2")
    splits = {"tp_plan": {"head": ColwiseParallel()}}
    out: dict[str, Any] = {
        "split_meta": refusal(lambda: faccel.prepare(dist, on_meta(Flat), **splits)),
        "split_eager": refusal(lambda: faccel.prepare(dist, eager(Flat), **splits)),
    }

    class Wider(Flat):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(8, 16)

    result = same_as_eager(dist, Wider, tp_plan={"up": ColwiseParallel()})
    inner = faccel.unwrap_model(result["model"])
    out["kept"] = [result["names"], result["equal"], inner.head.weight is inner.embed.weight]
    return out


def deepspeed_run() -> dict[str, Any]:
    """Under ZeRO-3 on 2 gloo ranks: a meta-built model (materialized whole, then partitioned by
    DeepSpeed) has the eager build's weights, and its optimizer steps the engine's parameters."""
    import os

    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed

    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    dist = faccel.detect(strategy="deepspeed", deepspeed=config)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 11))

    def engine(model: nn.Module) -> dict[str, list[int]]:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(data, batch_size=2)
        prepared, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
        x, y = next(iter(loader))
        faccel.backward(dist, (prepared(x) - y).square().mean())
        optimizer.step()
        out = {}
        for name, param in faccel.unwrap_model(prepared).named_parameters():
            with deepspeed.zero.GatheredParameters([param]):
                out[name] = bits(param.detach())
        return out

    torch.manual_seed(0)
    want = engine(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 11)))
    torch.manual_seed(0)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 11))
    got = engine(model)
    return {"names": sorted(want), "equal": sorted(n for n in want if want[n] == got.get(n))}
