"""Workers for tests/distributed/test_meta_build.py: a tiny GPT built eagerly and on meta, then prepared."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

import faccel


class Rotary(nn.Module):
    """A non-persistent table computed from the shape, refilled by ``reset_parameters`` (for a meta build)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.inv_freq.copy_(
                1.0 / (10000 ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], dtype=torch.float32, device=x.device)
        angles = torch.outer(positions, self.inv_freq.to(x.device))
        return x + torch.cat([angles.sin(), angles.cos()], dim=-1)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.down(torch.relu(self.up(self.norm(x)))))


class TinyGPT(nn.Module):
    """Embedding, blocks, a tied head, a rotary table: what the meta path must get right."""

    # Which way the head is tied (a built model does not record it): the meta build keeps embed's draw.
    _tied_weights_keys = {"head.weight": "embed.weight"}  # noqa: RUF012

    def __init__(self, vocab: int = 11, width: int = 8, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.rotary = Rotary(width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied after construction: the head's own draw is discarded

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.rotary(self.embed(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


PLAN_KEYS = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}


def tp_plan() -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {key: styles[style]() for key, style in PLAN_KEYS.items()}


def eager(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def on_meta() -> TinyGPT:
    with torch.device("meta"):
        return TinyGPT()


def full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole tensors of a prepared model's parameters and buffers, by name (DTensors gathered)."""
    inner = faccel.unwrap_model(model)
    out = {}
    for name, tensor in [*inner.named_parameters(), *inner.named_buffers()]:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        out[name] = full.detach().cpu()
    return out


def meta_matches_eager(*, layout: str | None, strategy: str, init: str = "reset") -> dict[str, Any]:
    """Prepare the eager build and the meta build in ``layout``; compare weights, shard sizes and a step."""
    kwargs: dict[str, Any] = {"strategy": strategy}
    if layout is not None:
        kwargs["layout"] = layout
    dist = faccel.detect(**kwargs)
    plan = tp_plan()
    reference = faccel.prepare(dist, eager(), tp_plan=plan)
    torch.manual_seed(0)
    meta = on_meta()
    prepared = faccel.prepare(dist, meta, tp_plan=plan)
    after_rng = torch.rand(3).tolist()  # the generator is where the eager build left it
    torch.manual_seed(0)
    TinyGPT()
    expected_rng = torch.rand(3).tolist()
    want, got = full_state(reference), full_state(prepared)
    inner = faccel.unwrap_model(prepared)
    # local storage: a sharded parameter holds its rows only
    local = {
        name: list((p.to_local() if hasattr(p, "to_local") else p).shape)
        for name, p in inner.named_parameters()
    }
    tokens = torch.arange(12).reshape(2, 6) % 11
    torch.manual_seed(1)
    loss = prepared(tokens).float().square().mean()
    loss.backward()
    grads = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).tolist()
        for name, p in inner.named_parameters()
    }
    return {
        "equal": sorted(n for n in want if torch.equal(want[n], got[n])),
        "names": sorted(want),
        "tied": inner.head.weight is inner.embed.weight,
        "rng": after_rng == expected_rng,
        "local": local,
        "loss": loss.item(),
        "grads": grads,
        "finite": all(math.isfinite(v) for t in got.values() for v in t.flatten().tolist()),
    }


def empty_then_load(*, root: str, layout: str | None, strategy: str, legacy: bool = False) -> dict[str, Any]:
    """``init='empty'``, then ``load_model`` of an eager build's save: the eager weights and logits."""
    kwargs: dict[str, Any] = {"strategy": strategy}
    if layout is not None:
        kwargs["layout"] = layout
    dist = faccel.detect(**kwargs)
    source = eager(seed=3)
    if dist.is_main_process:
        if legacy:  # a legacy pytorch_model.bin: read whole, each rank keeps its rows
            from pathlib import Path

            Path(root).mkdir(exist_ok=True)
            torch.save(
                {k: v.clone() for k, v in source.state_dict().items()}, Path(root) / "pytorch_model.bin"
            )
        else:
            faccel.save_model(faccel.detect({}), source, root)
    import torch.distributed as tdist

    tdist.barrier()
    prepared = faccel.prepare(dist, on_meta(), init="empty", tp_plan=tp_plan())
    from faccel._storage._local import _LocalReader

    read = _LocalReader.read_into
    counted: list[int] = []

    def counting(self: Any, target: Any, offset: int, at_least: int | None = None) -> None:
        # The real reads of tensor bytes, counted: the rows this rank took. A safetensors header is
        # read at offsets 0 (its length) and 8 (its JSON), through the same reader: not counted.
        if offset not in (0, 8):
            counted.append(memoryview(target).nbytes)
        read(self, target, offset, at_least)

    _LocalReader.read_into = counting  # type: ignore[method-assign]
    try:
        faccel.load_model(dist, prepared, root)
    finally:
        _LocalReader.read_into = read  # type: ignore[method-assign]
    sharded_bytes = sum(
        p.numel() * p.element_size()
        for p in faccel.unwrap_model(prepared).parameters()
        if hasattr(p, "to_local")
    )
    want, got = {k: v for k, v in [*source.named_parameters(), *source.named_buffers()]}, full_state(prepared)
    tokens = torch.arange(12).reshape(2, 6) % 11
    source.eval()
    prepared.eval()
    with torch.no_grad():
        gap = (source(tokens) - prepared(tokens).float()).abs().max().item()
    return {
        "equal": sorted(n for n in want if torch.equal(want[n].detach(), got[n])),
        "names": sorted(want),
        "gap": gap,
        "read": sum(counted),
        "sharded_bytes": sharded_bytes,
    }


def _grad_step(dist: Any, root: str, name: str, **options: Any) -> dict[str, Any]:
    """One forward and backward (dropout on) of a fresh TinyGPT prepared with ``options``; its save_model."""
    from faccel._loop._activation_checkpoint import is_checkpointed

    torch.manual_seed(0)
    model = TinyGPT(width=16)
    keys = list(model.state_dict())
    prepared = faccel.prepare(dist, model, **options)
    inner = faccel.unwrap_model(prepared)
    compute: list[str] = []
    inner.blocks[0].up.register_forward_hook(lambda m, args, out: compute.append(str(m.weight.dtype)))
    tokens = ((torch.arange(24).reshape(2, 12) + dist.rank) % 11).to(dist.device)
    torch.manual_seed(1 + dist.rank)  # the dropout masks differ by rank, and match with and without AC
    loss = prepared(tokens).float().square().mean()
    faccel.backward(dist, loss)
    # This rank's shard of each gradient (the same split in every FSDP2 case; DDP's are whole).
    grads = {
        name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).cpu().tolist()
        for name, p in inner.named_parameters()
    }
    grad_devices = sorted({str(p.grad.device.type) for p in inner.parameters()})
    faccel.save_model(dist, prepared, f"{root}/{name}")
    from tests.distributed.save_model_workers import hf_tensors  # one file, or (FSDP2) an index and shards

    saved = sorted(hf_tensors(Path(f"{root}/{name}")))
    return {
        "loss": loss.item(),
        "grads": grads,
        "keys": [keys, list(inner.state_dict())],
        "saved": saved,
        "checkpointed": [n for n, m in inner.named_modules() if is_checkpointed(m)],
        "sharded_dtypes": sorted({str(p.dtype) for p in inner.parameters()}),
        "sharded_devices": sorted({p.device.type for p in inner.parameters()}),
        "grad_devices": grad_devices,
        "compute": compute,
    }


def cuda_policies_run(*, root: str) -> dict[str, Any]:
    """On 2 GPUs (NCCL): FSDP2 with CPU offload, without, with reshard_after_forward=False, with AC."""
    fsdp = faccel.detect(strategy="fsdp")
    return {
        "device": str(fsdp.device),
        "fsdp": _grad_step(fsdp, root, "fsdp"),
        "fsdp_offload": _grad_step(fsdp, root, "fsdp_offload", offload="cpu"),
        "fsdp_keep": _grad_step(fsdp, root, "fsdp_keep", reshard_after_forward=False),
        "fsdp_ac": _grad_step(fsdp, root, "fsdp_ac", activation_checkpointing=Block),
    }


def policies_run(*, root: str) -> dict[str, Any]:
    """FSDP2 with and without activation checkpointing, resharding, CPU offload, bf16; DDP and tensor
    parallelism with and without AC; DDP refusing offload."""
    fsdp = faccel.detect(strategy="fsdp")
    out = {
        "fsdp": _grad_step(fsdp, root, "fsdp"),
        "fsdp_ac": _grad_step(fsdp, root, "fsdp_ac", activation_checkpointing=Block),
        "fsdp_keep": _grad_step(fsdp, root, "fsdp_keep", reshard_after_forward=False),
        "fsdp_ac_keep": _grad_step(
            fsdp, root, "fsdp_ac_keep", activation_checkpointing=Block, reshard_after_forward=False
        ),
        "fsdp_offload": _grad_step(fsdp, root, "fsdp_offload", offload="cpu"),
    }
    bf16 = faccel.detect(strategy="fsdp", precision="bf16")
    out["bf16"] = _grad_step(bf16, root, "bf16")
    out["bf16_ac"] = _grad_step(
        bf16, root, "bf16_ac", activation_checkpointing=lambda m: isinstance(m, Block)
    )
    ddp = faccel.detect(strategy="ddp")
    out["ddp"] = _grad_step(ddp, root, "ddp")
    out["ddp_ac"] = _grad_step(ddp, root, "ddp_ac", activation_checkpointing=Block)
    tensor = faccel.detect(layout="tensor=2")
    out["tp"] = _grad_step(tensor, root, "tp", tp_plan=tp_plan())
    out["tp_ac"] = _grad_step(tensor, root, "tp_ac", tp_plan=tp_plan(), activation_checkpointing=Block)
    try:
        faccel.prepare(ddp, TinyGPT(), offload="cpu")
    except faccel.errors.PrepareError as error:
        out["ddp_offload_refused"] = str(error)
    return out
