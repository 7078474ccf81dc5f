"""Workers for tests/distributed/test_pipeline.py: a user's own model in pipeline stages on gloo ranks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class Net(nn.Module):
    """A plain user's model: an input layer, four blocks in a ModuleList, a read-out."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


class Stage(nn.Module):
    """One stage of :class:`Net` built by hand (torchtitan's way): the same names, only its layers."""

    def __init__(self, stage: int, stages: int) -> None:
        super().__init__()
        whole = Net()  # same seed, same values: then keep this stage's part only
        per = 4 // stages
        self.first, self.last = stage == 0, stage == stages - 1
        self.embed = whole.embed if self.first else None
        self.layers = nn.ModuleDict({str(i): whole.layers[i] for i in range(stage * per, (stage + 1) * per)})
        self.head = whole.head if self.last else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            h = self.embed(h)
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.head(h) if self.head is not None else h


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(steps)]


# Where a names split cuts Net for 2 and 4 stages.
SPLITS = {2: ("layers.2",), 4: ("layers.1", "layers.2", "layers.3")}


def tp_plan() -> dict[str, Any]:
    """Every block split over the tensor ranks, its output gathered (the same plan fits every stage)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    return {"layers.*": ColwiseParallel(output_layouts=Replicate())}


def train(
    layout: str | None, kind: str, split: str, steps: int = 3, stages: int = 2, precision: str = "no"
) -> dict[str, Any]:
    """``steps`` steps of SGD with clipping through forward_backward; losses, norms, final weights by name.

    Each data-parallel rank takes its contiguous part of every batch of 8 (a mean loss over
    the part; FSDP2 averages the parts' gradients: the whole batch's mean).
    """
    import faccel

    dist = faccel.detect(None if layout else {}, layout=layout, precision=precision)
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    spec: Any = SPLITS[stages] if split == "names" else _stage_builder()
    schedule = faccel.Schedule(kind=kind, microbatches=4)
    plan = tp_plan() if dist.parallel.tensor > 1 else None
    model, optimizer = faccel.prepare(dist, model, optimizer, split=spec, schedule=schedule, tp_plan=plan)
    losses, norms = [], []
    for x, y in batches(steps):
        optimizer.zero_grad()
        part = dist.data_rank, dist.data_world_size
        x, y = x.chunk(part[1])[part[0]], y.chunk(part[1])[part[0]]
        loss = faccel.forward_backward(dist, model, nn.functional.mse_loss, x, y)
        loss = faccel.reduce(dist, loss, op="mean") if dist.data_world_size > 1 else loss
        norms.append(float(faccel.clip_grad_norm(dist, model, 0.5)))
        faccel.optimizer_step(dist, optimizer)
        losses.append(float(loss))
    weights = {}
    modules = model.stages if isinstance(model, faccel.PipelinedModel) else [model]
    for module in modules:
        for name, param in faccel.unwrap_model(module).named_parameters():
            value = param.full_tensor() if hasattr(param, "full_tensor") else param
            weights[name] = value.detach().flatten().tolist()
    stepped = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    return {"loss": losses, "norm": norms, "weights": weights, "stepped": stepped}


def _stage_builder() -> Any:
    def build(stage: int, stages: int) -> nn.Module:
        torch.manual_seed(0)
        return Stage(stage, stages)

    return build


def meta_stages() -> dict[str, Any]:
    """A meta-built model cut by a function that builds each stage on meta: what gets allocated."""
    import faccel

    dist = faccel.detect(layout="pipeline=2")
    with torch.device("meta"):
        model = Net()

    def build(stage: int, stages: int) -> nn.Module:
        with torch.device("meta"):
            return Stage(stage, stages)

    model = faccel.prepare(dist, model, split=build)
    x, y = batches(1)[0]
    loss = faccel.forward_backward(dist, model, nn.functional.mse_loss, x, y)
    local = {
        name: param.device.type
        for stage in model.stages
        for name, param in faccel.unwrap_model(stage).named_parameters()
    }
    return {"loss": float(loss), "local": local}


def accumulated(layout: str | None, by_items: bool, steps: int = 2) -> dict[str, Any]:
    """Accumulation of 2 micro-steps per optimizer step, the loss a mean or (``by_items``) a sum over rows."""
    import faccel

    dist = (
        faccel.detect(layout=layout, accumulation_steps=2)
        if layout
        else faccel.detect({}, accumulation_steps=2)
    )
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = faccel.prepare(dist, model, optimizer, split=SPLITS[2])
    data = batches(2 * steps)

    def summed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((output - target) ** 2).sum()

    loss_fn = summed if by_items else nn.functional.mse_loss
    count = (lambda batch: batch[0].shape[0]) if by_items else None
    losses = []
    for micro, (x, y) in faccel.micro_batches(dist, data, items=count):
        items = x.shape[0] if by_items else None
        loss = faccel.forward_backward(dist, model, loss_fn, x, y, micro=micro, items=items)
        losses.append(float(loss))
        if micro.sync:
            faccel.optimizer_step(dist, optimizer)
            optimizer.zero_grad()
    weights = {}
    modules = model.stages if isinstance(model, faccel.PipelinedModel) else [model]
    for module in modules:
        for name, param in faccel.unwrap_model(module).named_parameters():
            weights[name] = param.detach().flatten().tolist()
    return {"loss": losses, "weights": weights}


# (schedule, micro-batches, whether the loss takes gloo's early route) for loss_routes
LOSS_ROUTES = (("gpipe", 4, True), ("1f1b", 4, False), ("gpipe", 1, True))


def loss_routes() -> dict[str, Any]:
    """faccel's pipelined step against torch's schedule by hand, 3 steps per case of LOSS_ROUTES.

    By hand: the same stage and schedule, each micro-batch's loss times 1/count and
    ``scale_grads=False`` (what faccel asks of torch's schedule). Per case: whether each step's
    gradients are the same bits, faccel's loss on this rank, and by hand the mean of the
    micro-batch losses on the last stage. ``early=False`` takes the route of backends without
    tags (NCCL's: a broadcast after the schedule), here over gloo.
    """
    import attrs
    from torch.distributed import pipelining

    import faccel

    dist = faccel.detect(layout="pipeline=2")
    rank, data = dist.rank, batches(3)
    out: dict[str, Any] = {}
    for kind, count, early in LOSS_ROUTES:
        torch.manual_seed(0)
        schedule = faccel.Schedule(kind=kind, microbatches=count)
        model = faccel.prepare(dist, Net(), split=_stage_builder(), schedule=schedule, example=data[0][0])
        object.__setattr__(model, "_route", attrs.evolve(model._route, early=early))
        torch.manual_seed(0)
        hand = Stage(rank, 2)
        stage = pipelining.PipelineStage(hand, rank, 2, dist.device)

        def scaled(output: torch.Tensor, target: torch.Tensor, count: int = count) -> torch.Tensor:
            return nn.functional.mse_loss(output, target) * (1.0 / count)

        cls = pipelining.ScheduleGPipe if kind == "gpipe" else pipelining.Schedule1F1B
        by_hand = cls(stage, n_microbatches=count, loss_fn=scaled, scale_grads=False)
        mine = faccel.unwrap_model(model.stages[0])
        same, losses, hands = [], [], []
        for x, y in data:
            for param in [*mine.parameters(), *hand.parameters()]:
                param.grad = None
            losses.append(float(faccel.forward_backward(dist, model, nn.functional.mse_loss, x, y)))
            made: list[torch.Tensor] = []
            if rank == 0:
                by_hand.step(x)
            else:
                by_hand.step(target=y, losses=made)
                hands.append(float(torch.stack(made).sum()))  # each is loss / count: their mean
            theirs = dict(hand.named_parameters())
            same.append(all(torch.equal(p.grad, theirs[n].grad) for n, p in mine.named_parameters()))
        out[f"{kind}/{count}/{early}"] = {"same": same, "loss": losses, "hand": hands}
    return out


def refusals(root: str) -> dict[str, str]:
    """What is refused of a pipelined model's checkpoints and exports, each loudly, nothing written."""
    import faccel

    dist = faccel.detect(layout="pipeline=2")
    torch.manual_seed(0)
    net = Net()
    model, optimizer = faccel.prepare(dist, net, torch.optim.SGD(net.parameters(), lr=0.1), split=SPLITS[2])
    x, y = batches(1)[0]
    out = {}
    state = faccel.TrainState(model=model, optimizer=optimizer)
    try:  # the stages are built at the first forward_backward (or at prepare, with example=)
        faccel.checkpoint(dist, state, f"{root}/early")
        out["unbuilt"] = "written"
    except faccel.errors.FaccelError as error:
        out["unbuilt"] = f"{type(error).__name__}: {error}"
    import pathlib

    from safetensors.torch import save_file

    weights = pathlib.Path(root) / f"weights-{dist.rank}"
    weights.mkdir()
    save_file({k: v.contiguous() for k, v in Net().state_dict().items()}, str(weights / "model.safetensors"))
    try:
        faccel.load_model(dist, model, weights)
        out["unbuilt_load"] = "written"
    except faccel.errors.FaccelError as error:
        out["unbuilt_load"] = f"{type(error).__name__}: {error}"
    faccel.forward_backward(dist, model, nn.functional.mse_loss, x, y)
    calls = {
        "other_batch_size": lambda: faccel.forward_backward(
            dist, model, nn.functional.mse_loss, x[:4], y[:4]
        ),
        "whole_tensors": lambda: faccel.checkpoint(dist, state, f"{root}/whole", sharded=False),
        # a file without the head's bias (the last stage's): every rank names it, none loads anything
        "missing_name": lambda: faccel.load_model(dist, model, partial),
    }
    partial = pathlib.Path(root) / f"partial-{dist.rank}"
    partial.mkdir()
    tensors = {k: v.contiguous() for k, v in Net().state_dict().items() if k != "head.bias"}
    save_file(tensors, str(partial / "model.safetensors"))
    for name, call in calls.items():
        try:
            call()
            out[name] = "written"
        except faccel.errors.FaccelError as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


# Checkpoints of a pipelined model: 3 steps, a checkpoint, 2 more; restored at other layouts.
def _ckpt_setup(
    layout: str | None, world_batch: tuple[torch.Tensor, torch.Tensor], seed: int = 0
) -> tuple[Any, Any, Any]:
    import faccel

    dist = faccel.detect({}) if layout is None else faccel.detect(layout=layout)
    torch.manual_seed(seed)
    net = Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    layout_ = dist.parallel
    # tensor parallelism needs stages built from the model's modules (a function split)
    plan = tp_plan() if layout_.tensor > 1 else None
    if layout_.pipeline > 1:
        x = world_batch[0].chunk(dist.data_world_size)[dist.data_rank]
        schedule = faccel.Schedule(kind="1f1b", microbatches=4)
        split: Any = _stage_builder() if layout_.tensor > 1 else SPLITS[layout_.pipeline]
        # example=: the stages are built now (a restore needs them), from this rank's batch's shapes
        model, optimizer = faccel.prepare(
            dist, net, optimizer, split=split, schedule=schedule, example=x, tp_plan=plan
        )
    else:
        model, optimizer = faccel.prepare(dist, net, optimizer, tp_plan=plan)
    return dist, model, optimizer


def _ckpt_steps(dist: Any, model: Any, optimizer: Any, data: list[Any]) -> list[float]:
    import faccel

    losses = []
    for x, y in data:
        optimizer.zero_grad()
        if dist.distributed:
            part = dist.data_rank, dist.data_world_size
            x, y = x.chunk(part[1])[part[0]], y.chunk(part[1])[part[0]]
        loss = faccel.forward_backward(dist, model, nn.functional.mse_loss, x, y)
        loss = faccel.reduce(dist, loss, op="mean") if dist.distributed and dist.data_world_size > 1 else loss
        faccel.optimizer_step(dist, optimizer)
        losses.append(float(loss))
    return losses


def _ckpt_values(model: Any, optimizer: Any) -> dict[str, list[float]]:
    """This rank's weights and Adam moments, whole, by the model's own names (bitwise: exact floats)."""
    import faccel

    modules = model.stages if isinstance(model, faccel.PipelinedModel) else [model]
    out: dict[str, list[float]] = {}
    for module in modules:
        for name, param in faccel.unwrap_model(module).named_parameters():
            for what, value in [("weight", param), *sorted(optimizer.state.get(param, {}).items())]:
                if not isinstance(value, torch.Tensor):
                    continue
                whole = value.full_tensor() if hasattr(value, "full_tensor") else value
                out[f"{name}:{what}"] = whole.detach().flatten().tolist()
    return out


def ckpt_save(
    layout: str | None, root: str, load: str | None = None, blocking: bool = True, export: str | None = None
) -> dict[str, Any]:
    """3 Adam steps at ``layout``, a checkpoint at step 3, 2 more steps: the values at 3, the later losses.

    ``load``: the model is built from another seed and its weights loaded with load_model from that
    folder (a one-process save_model of the seed's weights); ``loaded`` is what this rank then holds.
    ``blocking=False``: the checkpoint is written in the background while the 2 steps run.
    ``export``: after the 2 steps, save_model into that folder; ``final`` is this rank's weights then.
    """
    import faccel

    data = batches(5)
    dist, model, optimizer = _ckpt_setup(layout, data[0], seed=0 if load is None else 7)
    loaded = None
    if load is not None:
        faccel.load_model(dist, model, load)
        loaded = {k: v for k, v in _ckpt_values(model, optimizer).items() if k.endswith(":weight")}
    before = _ckpt_steps(dist, model, optimizer, data[:3])
    values = _ckpt_values(model, optimizer)
    faccel.checkpoint(
        dist, faccel.TrainState(model=model, optimizer=optimizer, step=3), root, blocking=blocking
    )
    after = _ckpt_steps(dist, model, optimizer, data[3:])
    if not blocking:  # committed before the process ends (as the next checkpoint, restore or shutdown would)
        from faccel._checkpoint._background import wait as wait_for_background

        wait_for_background(dist.runtime, dist)
    final = None
    if export is not None:
        faccel.save_model(dist, model, export)
        final = {k: v for k, v in _ckpt_values(model, optimizer).items() if k.endswith(":weight")}
    return {"before": before, "values": values, "after": after, "loaded": loaded, "final": final}


def ckpt_resume(layout: str | None, root: str) -> dict[str, Any]:
    """A fresh model at ``layout`` restored from ``root``: the values restored, then the 2 later steps."""
    import faccel

    data = batches(5)
    dist, model, optimizer = _ckpt_setup(layout, data[0])
    state = faccel.restore(dist, faccel.TrainState(model=model, optimizer=optimizer), root)
    values = _ckpt_values(model, optimizer)
    after = _ckpt_steps(dist, model, optimizer, data[3:])
    return {"step": state.step, "values": values, "after": after}


def ckpt_other_model(root: str) -> str:
    """A checkpoint of a model with one tensor more (written in one process), restored into stages."""
    import faccel

    data = batches(5)
    dist, model, optimizer = _ckpt_setup("pipeline=2", data[0])
    try:
        faccel.restore(dist, faccel.TrainState(model=model, optimizer=optimizer), root)
    except faccel.errors.CheckpointError as error:
        return str(error)
    return "restored"


def ckpt_save_model(out: str) -> dict[str, Any]:
    """save_model of a pipelined model after 3 steps: each rank writes its stage's tensors."""
    import faccel

    data = batches(3)
    dist, model, optimizer = _ckpt_setup("pipeline=2", data[0])
    _ckpt_steps(dist, model, optimizer, data)
    faccel.save_model(dist, model, out)
    return {k: v for k, v in _ckpt_values(model, optimizer).items() if k.endswith(":weight")}


def load_into_stages(layout: str, folder: str) -> dict[str, Any]:
    """load_model of a one-process save_model (``Net`` at seed 0) into stages of ``Net`` at seed 7, then
    one Adam step: the weights as loaded (this rank's, by name) and the step's loss."""
    import faccel

    data = batches(1)
    dist = faccel.detect(layout=layout)
    torch.manual_seed(7)  # other weights than the saved ones: load_model must replace every one
    net = Net()
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    x = data[0][0].chunk(dist.data_world_size)[dist.data_rank]
    schedule = faccel.Schedule(kind="1f1b", microbatches=4)
    model, optimizer = faccel.prepare(dist, net, optimizer, split=SPLITS[2], schedule=schedule, example=x)
    faccel.load_model(dist, model, folder)
    loaded = {k: v for k, v in _ckpt_values(model, optimizer).items() if k.endswith(":weight")}
    losses = _ckpt_steps(dist, model, optimizer, data)
    after = {k: v for k, v in _ckpt_values(model, optimizer).items() if k.endswith(":weight")}
    return {"loaded": loaded, "loss": losses, "after": after}


def one_process_step(folder: str | None) -> dict[str, Any]:
    """``Net`` at seed 0 in one process (saved with save_model into ``folder`` first), one Adam step."""
    import faccel

    dist = faccel.detect({})
    torch.manual_seed(0)
    net = Net()
    if folder is not None:
        faccel.save_model(dist, net, folder)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    before = {f"{k}:weight": v.detach().flatten().tolist() for k, v in net.named_parameters()}
    losses = _ckpt_steps(dist, net, optimizer, batches(1))
    after = {f"{k}:weight": v.detach().flatten().tolist() for k, v in net.named_parameters()}
    return {"loaded": before, "loss": losses, "after": after}


def tiny_llama() -> Any:
    """A tiny Llama from its config (no hub), its head not tied to the embedding (the two are in
    different stages), sdpa attention (causal when no mask is given)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


class LlamaStage(nn.Module):
    """One stage of a ``LlamaForCausalLM`` built from its own modules, with the model's names:
    the embedding on the first, the final norm and the head on the last, the rotary table on each."""

    def __init__(self, whole: Any, stage: int, stages: int) -> None:
        super().__init__()
        inner = whole.model
        per = len(inner.layers) // stages
        self.model = nn.Module()
        self.model.embed_tokens = inner.embed_tokens if stage == 0 else None
        self.model.layers = nn.ModuleDict(
            {str(i): inner.layers[i] for i in range(stage * per, (stage + 1) * per)}
        )
        self.model.norm = inner.norm if stage == stages - 1 else None
        self.model.rotary_emb = inner.rotary_emb
        self.lm_head = whole.lm_head if stage == stages - 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.model.embed_tokens is not None:
            h = self.model.embed_tokens(h)
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        cos_sin = self.model.rotary_emb(h, positions)
        for layer in self.model.layers.values():
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            h = h[0] if isinstance(h, tuple) else h
        return self.lm_head(self.model.norm(h)) if self.lm_head is not None else h


def _token_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    logits = output if isinstance(output, torch.Tensor) else output.logits  # a stage gives the tensor
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


def llama_export(layout: str | None, out: str) -> None:
    """A tiny Llama, 2 SGD steps on random tokens (one process, or stages built from its modules),
    then save_model into ``out``."""
    import faccel

    dist = faccel.detect({}) if layout is None else faccel.detect(layout=layout)
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, 64, (4, 9), generator=g) for _ in range(2)]
    if layout is not None:
        whole = model

        def build(stage: int, stages: int) -> nn.Module:
            return LlamaStage(whole, stage, stages)

        schedule = faccel.Schedule(kind="1f1b", microbatches=2)
        model, optimizer = faccel.prepare(dist, model, optimizer, split=build, schedule=schedule)
    for batch in tokens:
        optimizer.zero_grad()
        faccel.forward_backward(dist, model, _token_loss, batch[:, :-1], batch[:, 1:])
        faccel.optimizer_step(dist, optimizer)
    faccel.save_model(dist, model, out)


# The failure table (scripts/prove_pipeline_failures.py, tests/distributed/test_pipeline_failures.py):
# each case a mistake or a death on one or both ranks of pipeline=2 (1F1B, 4 micro-batches).
FAILURES = (
    "empty_split",
    "batch_of_10",
    "batch_of_3",
    "non_scalar_loss",
    "dict_output",
    "loss_raises",
    "forward_raises",
    "tied_weight",
    "tied_weight_built",
    "killed_mid_step",
    "killed_between_steps",
    "killed_before_clip",
)


class _Tied(Net):
    """Net with its first and last blocks sharing one weight: the two sit in different stages."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[3].weight = self.layers[0].weight


class _PartOf(nn.Module):
    """Stage ``stage`` of 2 built from a whole :class:`Net`'s own modules (torchtitan's way)."""

    def __init__(self, whole: Net, stage: int) -> None:
        super().__init__()
        self.embed = whole.embed if stage == 0 else None
        self.layers = nn.ModuleDict({str(i): whole.layers[i] for i in range(2 * stage, 2 * stage + 2)})
        self.head = whole.head if stage == 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.embed(h) if self.embed is not None else h
        for layer in self.layers.values():
            h = torch.tanh(layer(h))
        return self.head(h) if self.head is not None else h


class _DictStage(Stage):
    """A stage whose last returns a dict (a Hugging Face style output)."""

    def forward(self, h: torch.Tensor) -> Any:
        out = super().forward(h)
        return {"logits": out} if self.last else out


class _Raising(Stage):
    """A stage whose forward raises from the second step on (after the stages are built)."""

    def __init__(self, stage: int, stages: int) -> None:
        super().__init__(stage, stages)
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 8:  # the first step: 4 micro-batches, and torch's shape inference
            msg = "a bad row in the user's forward"
            raise ValueError(msg)
        return super().forward(h)


def failures(cases: list[str]) -> dict[str, str]:
    """Each case of FAILURES in turn on this rank: what it raised, ``"TypeName: message"`` (or ``"ok"``).

    Several cases share one launch only where each is refused on every rank before any message
    (the process group stays usable); a case that fails on one rank ends the launch.
    """
    import faccel

    dist = faccel.detect(layout="pipeline=2")
    return {case: _failure(dist, case) for case in cases}


def _failure(dist: Any, case: str) -> str:
    """One case of FAILURES on this rank."""
    import os

    import faccel

    torch.manual_seed(0)
    net: nn.Module = _Tied() if case.startswith("tied_weight") else Net()
    split: Any = ("",) if case == "empty_split" else SPLITS[2]
    if case == "tied_weight_built":  # stages built from the tied model's own modules (a function split)

        def split(stage: int, stages: int) -> nn.Module:
            return _PartOf(net, stage)

    if case in ("dict_output", "forward_raises"):
        cls = _DictStage if case == "dict_output" else _Raising

        def split(stage: int, stages: int) -> nn.Module:
            torch.manual_seed(0)
            return cls(stage, stages)

    loss_fn: Any = nn.functional.mse_loss
    if case == "non_scalar_loss":
        loss_fn = nn.functional.mse_loss if dist.rank == 0 else (lambda o, t: (o - t) ** 2)
    elif case == "dict_output":

        def loss_fn(output: Any, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.mse_loss(output["logits"], target)
    elif case == "loss_raises":

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            msg = "the user's loss function failed"
            raise ValueError(msg)
    elif case == "killed_mid_step":

        def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            if steps_done:  # the second step, inside the schedule: this process dies (rank 1's)
                os._exit(0)
            return nn.functional.mse_loss(output, target)

    rows = {"batch_of_10": 10, "batch_of_3": 3}.get(case, 8)
    steps_done = 0
    try:
        schedule = faccel.Schedule(kind="1f1b", microbatches=4)
        model, optimizer = faccel.prepare(
            dist, net, torch.optim.SGD(net.parameters(), lr=0.1), split=split, schedule=schedule
        )
        g = torch.Generator().manual_seed(1)
        for _ in range(3):
            x, y = torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)
            if case == "killed_between_steps" and steps_done == 1 and dist.rank == 1:
                os._exit(0)
            faccel.forward_backward(dist, model, loss_fn, x, y)
            if case == "killed_before_clip" and steps_done == 1 and dist.rank == 1:
                os._exit(0)
            faccel.clip_grad_norm(dist, model, 1.0)  # a sum over the stages
            faccel.optimizer_step(dist, optimizer)
            steps_done += 1
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "ok"
