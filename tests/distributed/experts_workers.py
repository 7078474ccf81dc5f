"""Workers for tests/distributed/test_experts.py: a tiny Mixtral (transformers) trained under
``Layout(expert=...)`` beside the one-process run of the same global batches, in the same process."""

from __future__ import annotations

import copy
import datetime
import json
import os
from typing import Any

import torch

import faccel

STEPS = 3


def tiny_mixtral(seed: int = 0, experts: int = 4) -> Any:
    """A 2-layer Mixtral of ``experts`` experts, top-2, built from a config (eager experts)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    config._experts_implementation = "eager"  # see docs/parallelism.md: the grouped_mm kernel's rows
    torch.manual_seed(seed)
    return MixtralForCausalLM(config)


def batches_of(world: int, per_rank: int = 2, length: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (world * per_rank, length), generator=generator) for _ in range(STEPS)]


def _one_step(model: Any, optimizer: Any, batch: torch.Tensor) -> float:
    loss = model(batch, labels=batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss.detach())


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def digests(model: Any, optimizer: Any) -> dict[str, str]:
    """sha256 of every whole parameter and optimizer state tensor, by name (collective for DTensors)."""
    import hashlib

    out = {}
    for name, param in faccel.unwrap_model(model).named_parameters():
        out[name] = hashlib.sha256(_whole(param).numpy().tobytes()).hexdigest()
        for key, value in optimizer.state.get(param, {}).items():
            out[f"{name}:{key}"] = hashlib.sha256(_whole(value).cpu().numpy().tobytes()).hexdigest()
    return out


def train_both(*, layout: str, root: str | None = None, model_dir: str | None = None) -> dict[str, Any]:
    """:func:`train` as it is and skewed, in the same processes (one start of each process); the even
    run checkpointed into ``root`` and saved with ``save_model`` into ``model_dir``."""
    dist = faccel.detect(layout=layout)
    return {"even": train(dist, root=root, model_dir=model_dir), "skew": train(dist, skew=True)}


def train(
    dist: Any,
    *,
    skew: bool = False,
    capacity: float | None = None,
    root: str | None = None,
    model_dir: str | None = None,
) -> dict[str, Any]:
    """``STEPS`` AdamW steps under ``layout`` and in one process; the losses, the weights' differences.

    ``skew``: every router weight zero, so every token goes to the same two experts (one rank's),
    none to the others; then SGD, since at such ties AdamW's first steps (``g / |g|``) turn rounding into
    steps of the learning rate. The one-process run sees every rank's rows in rank order: the
    global batch.
    """
    one = faccel.detect({})  # the one-process run, in this process
    model = tiny_mixtral()
    if skew:
        for name, param in model.named_parameters():
            if name.endswith("gate.weight"):
                torch.nn.init.zeros_(param)
    reference = copy.deepcopy(model)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "MixtralExperts"]
    kind = torch.optim.SGD if skew else torch.optim.AdamW
    ref_optimizer = kind(reference.parameters(), lr=1e-2)
    # the one-process run through the same dispatch, with every expert here
    faccel.prepare(one, reference, ref_optimizer, experts=names, expert_capacity=capacity)
    optimizer = kind(model.parameters(), lr=1e-2)
    prepared, optimizer = faccel.prepare(dist, model, optimizer, expert_capacity=capacity)
    batches = batches_of(dist.data_world_size)
    losses, reference_losses, loads = [], [], []
    for batch in batches:
        rows = batch.chunk(dist.data_world_size)[dist.data_rank]
        loss = _one_step(prepared, optimizer, rows)
        losses.append(float(faccel.reduce(dist, torch.tensor(loss), "mean")))
        loads.append({k: v for k, v in faccel.expert_load(dist).items()})
    one_loads = []
    for batch in batches:
        reference_losses.append(_one_step(reference, ref_optimizer, batch))
        one_loads.append({k: v["routed"] for k, v in faccel.expert_load(one).items()})
    # every weight, whole (an expert's DTensor gathered), against the one-process model's
    inner = faccel.unwrap_model(prepared)
    whole = dict(reference.named_parameters())
    worst = {
        name: float((_whole(param) - whole[name].detach()).abs().max())
        for name, param in inner.named_parameters()
    }
    keys = list(inner.state_dict())
    saved: dict[str, Any] = {}
    if root is not None and model_dir is not None:
        state = faccel.TrainState.create(model=prepared, optimizer=optimizer)
        faccel.checkpoint(dist, state, root)
        faccel.save_model(dist, prepared, model_dir)
        probe = batches[0][:2]
        saved = {"digests": digests(prepared, optimizer), "logits": inner(probe).logits.detach().tolist()}
    return {
        **saved,
        "losses": losses,
        "reference": reference_losses,
        "worst": worst,
        "keys": keys,
        "shapes": {k: list(_local(v).shape) for k, v in inner.state_dict().items() if "experts" in k},
        "routed": [{k: v["routed"] for k, v in step.items()} for step in loads],
        "dropped": [{k: v["dropped"] for k, v in step.items()} for step in loads],
        "world_routed": [{k: v["world_routed"] for k, v in step.items()} for step in loads],
        "one_routed": one_loads,
    }


class Experts(torch.nn.Module):
    """A plain-torch experts module under faccel's contract (no transformers import: a fast start)."""

    def __init__(self, experts: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.num_experts = experts
        self.up = torch.nn.Parameter(torch.randn(experts, 2 * hidden, hidden) / hidden**0.5)
        self.down = torch.nn.Parameter(torch.randn(experts, hidden, 2 * hidden) / hidden**0.5)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in range(self.num_experts):  # each expert's rows by slot, then token (as transformers')
            slot, token = torch.where(index.t() == expert)
            rows = torch.relu(hidden[token] @ self.up[expert].t()) @ self.down[expert].t()
            out = out.index_add(0, token, rows * weights[token, slot, None])
        return out


class Block(torch.nn.Module):
    """A router and its experts, top-2."""

    def __init__(self, experts: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(experts, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = torch.topk(torch.softmax(self.gate(x), dim=-1), 2, dim=-1)
        return self.experts(x, index, weights)


def peer_dies_in_the_all_to_all() -> dict[str, Any]:
    """Rank 1 exits before its forward; rank 0's forward meets the dead peer in the all-to-all.

    The unwrapped model's forward, so that the all-to-all is the first collective rank 0 enters
    (DDP's own forward first broadcasts the buffers, and would meet the dead peer there).
    """
    dist = faccel.detect(layout="expert=2", timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    prepared = faccel.prepare(dist, Block())
    if dist.rank == 1:
        os._exit(0)
    try:
        faccel.unwrap_model(prepared)(torch.randn(6, 8))
    except faccel.errors.DistributedError as error:
        return {"error": str(error)}
    return {"error": None}


def restore_into(*, layout: str, root: str) -> dict[str, str]:
    """The checkpoint in ``root`` restored into a fresh model under ``layout``: its whole digests."""
    dist = faccel.detect(layout=layout)
    model = tiny_mixtral(seed=5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    state = faccel.restore(dist, faccel.TrainState.create(model=model, optimizer=optimizer), root)
    return digests(state.model, optimizer)


def load_into(*, layout: str, model_dir: str) -> dict[str, str]:
    """``save_model``'s export read by ``load_model`` into a fresh model under ``layout``: its digests
    (parameters only; each rank kept its own experts' rows)."""
    dist = faccel.detect(layout=layout)
    model = faccel.prepare(dist, tiny_mixtral(seed=5))
    faccel.load_model(dist, model, model_dir)
    shapes = {
        n: list(_local(p).shape) for n, p in faccel.unwrap_model(model).named_parameters() if "experts" in n
    }
    return {**digests(model, torch.optim.SGD([torch.zeros(1)])), "shapes": json.dumps(shapes)}


class MoeNet(torch.nn.Module):
    """A user's own mixture-of-experts model: an input layer, two residual MoE blocks, a read-out."""

    def __init__(self, experts: int = 4, hidden: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, hidden)
        self.layers = torch.nn.ModuleList(Block(experts, hidden) for _ in range(2))
        self.head = torch.nn.Linear(hidden, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.layers:
            h = h + block(h)
        return self.head(h)


class MoeStage(torch.nn.Module):
    """One pipeline stage of :class:`MoeNet` built by hand: the same names, its block only."""

    def __init__(self, stage: int, stages: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        whole = MoeNet()  # the same seed, the same values: then keep this stage's part only
        self.embed = whole.embed if stage == 0 else None
        self.layers = torch.nn.ModuleDict({str(stage): whole.layers[stage]})
        self.head = whole.head if stage == stages - 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for block in self.layers.values():
            h = h + block(h)
        return self.head(h) if self.head is not None else h


def experts_beside(
    *, layout: str | None, root: str | None = None, steps: int = 3, strategy: str | None = None
) -> dict[str, Any]:
    """``steps`` AdamW steps of :class:`MoeNet` through ``forward_backward`` under ``layout`` (experts
    split over the expert ranks beside pipeline stages, tensor parallelism or replicas), or in one
    process without one; the losses, every whole weight by name, each rank's rows of each expert
    tensor; checkpointed into ``root``.
    """
    chosen = {} if strategy is None else {"strategy": strategy}
    dist = faccel.detect(None if layout else {}, layout=layout, **chosen)
    torch.manual_seed(0)
    model = MoeNet()
    names = [n for n, m in model.named_modules() if isinstance(m, Experts)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    options: dict[str, Any] = {"experts": names}
    if dist.parallel.pipeline > 1:
        options.update(split=MoeStage, schedule=faccel.Schedule(kind="1f1b", microbatches=2))
    if dist.parallel.tensor > 1:  # the input and read-out layers split over the tensor ranks
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel

        plan = ColwiseParallel(output_layouts=Replicate())
        options.update(tp_plan={"embed": plan, "head": plan})
    model, optimizer = faccel.prepare(dist, model, optimizer, **options)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(8, 8, generator=generator), torch.randn(8, 4, generator=generator)
        part = dist.data_rank, dist.data_world_size
        x, y = x.chunk(part[1])[part[0]], y.chunk(part[1])[part[0]]
        optimizer.zero_grad()
        loss = faccel.forward_backward(dist, model, torch.nn.functional.mse_loss, x, y)
        losses.append(float(faccel.reduce(dist, loss, "mean") if dist.data_world_size > 1 else loss))
        faccel.optimizer_step(dist, optimizer)
    modules = model.stages if isinstance(model, faccel.PipelinedModel) else [model]
    weights, rows = {}, {}
    for module in modules:
        for name, param in faccel.unwrap_model(module).named_parameters():
            weights[name] = _whole(param).flatten().tolist()
            if "experts" in name:
                rows[name] = _local(param).shape[0]
    if root is not None:
        faccel.checkpoint(dist, faccel.TrainState.create(model=model, optimizer=optimizer), root)
    return {"losses": losses, "weights": weights, "rows": rows}


def moe_net_restored(root: str) -> dict[str, list[float]]:
    """The checkpoint in ``root`` restored into a fresh :class:`MoeNet` in one process: its weights."""
    dist = faccel.detect({})
    torch.manual_seed(5)
    model = MoeNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    state = faccel.restore(dist, faccel.TrainState.create(model=model, optimizer=optimizer), root)
    return {name: param.detach().flatten().tolist() for name, param in state.model.named_parameters()}
