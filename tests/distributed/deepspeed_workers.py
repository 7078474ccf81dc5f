"""Workers of the DeepSpeed tests: the seed loop under strategy='deepspeed' and the same under DDP.

Imported only by tests/distributed/test_deepspeed.py, which skips without deepspeed;
deepspeed itself is imported inside faccel's engine module when the engine is built.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def _task() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(96, 6, generator=generator)
    y = x @ torch.randn(6, 2, generator=generator) + 0.1 * torch.randn(96, 2, generator=generator)
    return x, y


def _model() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _items(batch: Any) -> int:
    # The targets whose first value is positive: a count that varies by batch and rank.
    return int((batch[1][:, 0] > 0).sum())


def seed_loop(
    *,
    strategy: str,
    stage: int = 2,
    accumulation_steps: int = 1,
    steps: int = 6,
    config: Any = None,
    samples: int = 96,
    epochs: int = 1,
    items: bool = False,
    sgd: bool = False,
) -> dict[str, Any]:
    """The seed loop (micro-steps when accumulating) for ``steps`` optimizer steps over up to
    ``epochs`` epochs of the first ``samples`` samples; the weights at the end. With ``items``,
    the loss is a sum over the counted targets (``_items``) and backward divides by the group's count;
    with ``sgd``, SGD with momentum instead of AdamW."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import faccel

    options: dict[str, Any] = {}
    if strategy == "deepspeed":
        options["deepspeed"] = config if config is not None else {"zero_optimization": {"stage": stage}}
    dist = faccel.detect(strategy=strategy, accumulation_steps=accumulation_steps, **options)
    model = _model()
    if sgd:  # the step follows the gradient's scale (AdamW's hardly does): a mis-scaled group shows
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    x, y = _task()
    dataset = torch.utils.data.TensorDataset(x[:samples], y[:samples])
    raw = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = faccel.prepare(dist, model, optimizer, raw, scheduler)
    done, group_sizes = 0, []
    for epoch in range(epochs):
        count = _items if items else None
        for micro, (inputs, targets) in faccel.micro_batches(dist, loader.at(epoch=epoch), items=count):
            with faccel.accumulate(dist, model, micro):
                if items:
                    keep = targets[:, 0] > 0
                    error = (model(inputs) - targets)[keep]
                    faccel.backward(dist, error.pow(2).sum(), micro=micro, items=int(keep.sum()))
                else:
                    loss = torch.nn.functional.mse_loss(model(inputs), targets)
                    faccel.backward(dist, loss, micro=micro)
            if micro.sync:
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                group_sizes.append(micro.group_size)
                done += 1
                if done == steps:
                    break
        if done == steps:
            break
    result: dict[str, Any] = {
        "kind": type(model).__name__,
        "lr": optimizer.param_groups[0]["lr"],
        "steps": done,
        "group_sizes": group_sizes,
    }
    if strategy == "deepspeed":
        result["config"] = {
            key: model.config[key]
            for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
        }
        result["clipping"] = model.gradient_clipping()
        result["stage"] = model.zero_optimization_stage()
        result["offload"] = bool(model.zero_cpu_offload())
    result["params"] = _full_params(dist, model)
    return result


def _full_params(dist: Any, model: torch.nn.Module) -> list[list[float]]:
    import faccel

    inner = faccel.unwrap_model(model)
    if any(hasattr(p, "ds_id") for p in inner.parameters()):
        import deepspeed

        out = []
        for param in inner.parameters():
            with deepspeed.zero.GatheredParameters([param]):
                out.append(param.detach().flatten().tolist())
        return out
    return [p.detach().flatten().tolist() for p in inner.parameters()]


def _zero(stage: int) -> dict[str, Any]:
    # Threshold 0: ZeRO-3 partitions even this tiny model's parameters (by default it keeps
    # parameters under 1e5 elements whole on every rank).
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"zero_optimization": zero}


def _odd_model() -> torch.nn.Module:
    # 65 parameters, a bias of 7: ZeRO's partitions are padded, and one parameter spans two ranks.
    torch.manual_seed(2)
    return torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


def sections(kind: str) -> dict[str, Any]:
    """A config's optimizer and scheduler sections, as Accelerate's DummyOptim/DummyScheduler users
    write them: DeepSpeed's ``kind`` ("AdamW" with torch's AdamW, or "Adam": DeepSpeed's FusedAdam)."""
    params: dict[str, Any] = {"lr": "auto", "weight_decay": "auto"}
    if kind == "AdamW":
        params["torch_adam"] = True
    schedule = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "total_num_steps")
    return {
        "optimizer": {"type": kind, "params": params},
        "scheduler": {"type": "WarmupDecayLR", "params": dict.fromkeys(schedule, "auto")},
    }


def _prepared(dist: Any, from_config: bool = False) -> tuple[Any, ...]:
    import faccel

    model = _odd_model()
    # Two groups (no weight decay on the biases): ZeRO keeps a flat partition per group.
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": weights, "weight_decay": 0.01}, {"params": biases, "weight_decay": 0.0}]
    optimizer: Any
    scheduler: Any
    if from_config:  # DeepSpeed builds both from the config's sections
        optimizer = faccel.ConfigOptimizer(params=groups, lr=0.01, weight_decay=0.01)
        scheduler = faccel.ConfigScheduler(warmup_num_steps=3, total_num_steps=9)
    else:
        optimizer = torch.optim.AdamW(groups, lr=0.01)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    x, y = _task()
    raw = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = faccel.prepare(dist, model, optimizer, raw, scheduler)
    state = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    return model, optimizer, loader, scheduler, state


def _train(
    dist: Any,
    objects: tuple[Any, ...],
    state: Any,
    *,
    until: int,
    root: str,
    save_at: int = 0,
    blocking: bool = True,
) -> Any:
    import attrs

    import faccel

    model, optimizer, loader, scheduler, _ = objects
    # DeepSpeed's bf16 and fp16 weights take inputs of their dtype.
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(dist.precision)
    for inputs, targets in loader.resume(state):
        outputs = model(inputs.to(low)) if low is not None else model(inputs)
        loss = torch.nn.functional.mse_loss(outputs.float(), targets)
        faccel.backward(dist, loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        state = attrs.evolve(state, step=state.step + 1, position=state.position + 1)
        if state.step == save_at:
            faccel.checkpoint(dist, state, root, blocking=blocking)
        if state.step == until:
            break
    return state


def _zero_view(model: Any) -> dict[str, list[list[float]]]:
    """The whole fp32 masters and AdamW moments, read through DeepSpeed's own API."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    view: dict[str, list[list[float]]] = {"master": [], "exp_avg": [], "exp_avg_sq": []}
    for param in model.module.parameters():  # the order of the model, not of the groups
        view["master"].append(safe_get_full_fp32_param(param).flatten().tolist())
        for key in ("exp_avg", "exp_avg_sq"):
            view[key].append(safe_get_full_optimizer_state(param, key).flatten().tolist())
    return view


def _scaler_view(model: Any) -> dict[str, Any]:
    """The fp16 loss scaler's numbers and the engine's skipped steps (empty without fp16)."""
    scaler = getattr(model.optimizer, "loss_scaler", None)
    if scaler is None or not model.fp16_enabled():
        return {}
    keys = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
    return {"skipped": model.skipped_steps, **{key: getattr(scaler, key) for key in keys}}


# fp16 whose dynamic loss scale starts at 2**16 and doubles after every 2 clean steps, so it
# overflows again and again: by step 6 the scaler has skipped steps and moved its scale both ways.
FP16 = {"initial_scale_power": 16, "loss_scale_window": 2, "hysteresis": 1}


def stop_and_resume(
    *,
    stage: int,
    root: str,
    stop: int = 6,
    steps: int = 9,
    precision: str = "no",
    accelerator: str = "cpu",
    offload: bool = False,
    from_config: str | None = None,
) -> dict[str, Any]:
    """A run checkpointed at ``stop`` and trained on to ``steps``; then a fresh engine restored from
    the checkpoint and trained to ``steps`` too, in the same processes: both final weights.
    ``accelerator="cuda"``: DeepSpeed's GPU path (tests/test_cuda.py); ``offload``: ZeRO-Offload of
    the optimizer state to the CPU; ``from_config``: DeepSpeed's optimizer of that type and a
    WarmupDecayLR schedule from the config's sections (:func:`sections`)."""
    os.environ["DS_ACCELERATOR"] = accelerator
    import faccel

    config = _zero(stage)
    if precision == "fp16":
        config["fp16"] = dict(FP16)
    if offload:  # a torch optimizer, not DeepSpeedCPUAdam: DeepSpeed must be told to take it
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False
    if from_config is not None:
        config.update(sections(from_config))
    dist = faccel.detect(strategy="deepspeed", deepspeed=config, precision=precision)
    first = _prepared(dist, from_config is not None)
    # ZeRO-3 saves in the background (blocking=False) while training goes on; ZeRO-2 blocks.
    state = _train(dist, first, first[4], until=stop, root=root, save_at=stop, blocking=stage != 3)
    saved = _zero_view(first[0])
    saved_scaler = _scaler_view(first[0])
    _train(dist, first, state, until=steps, root=root)
    uninterrupted = _full_params(dist, first[0])
    ended_scaler = _scaler_view(first[0])
    second = _prepared(dist, from_config is not None)
    fresh_scaler = _scaler_view(second[0])
    restored = faccel.restore(dist, second[4], root)
    after_restore = _zero_view(second[0])
    restored_scaler = _scaler_view(second[0])
    ended = _train(dist, second, restored, until=steps, root=root)
    folder = faccel.latest_checkpoint(root)
    files = _names_in(folder)
    return {
        "uninterrupted": uninterrupted,
        "resumed": _full_params(dist, second[0]),
        "saved": saved,
        "after_restore": after_restore,
        "restored_step": restored.step,
        "ended_step": ended.step,
        "lr": [first[1].param_groups[0]["lr"], second[1].param_groups[0]["lr"]],
        "schedule": [repr(first[3]), first[3].last_epoch, second[3].last_epoch, second[3].get_last_lr()],
        "optimizer": type(first[1].optimizer).__name__,
        "counters": [first[0].global_steps, second[0].global_steps],
        "files": files,
        "scaler": {
            "saved": saved_scaler,
            "fresh": fresh_scaler,
            "restored": restored_scaler,
            "ended": [ended_scaler, _scaler_view(second[0])],
        },
    }


def _names_in(folder: Any) -> list[str]:
    """The names in a checkpoint folder: a local Path, or a URL (an object store's prefix)."""
    if folder is None:
        return []
    if isinstance(folder, str):
        import fsspec

        fs, key = fsspec.core.url_to_fs(folder)
        fs.invalidate_cache()
        return sorted(path.rsplit("/", 1)[1] for path in fs.ls(key))
    return sorted(path.name for path in folder.iterdir())


def restore_elsewhere(*, stage: int, root: str, steps: int = 2) -> dict[str, Any]:
    """A fresh engine (any world size, any stage) restored from ``root``; its ZeRO state, then trained on."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    import faccel

    dist = faccel.detect(strategy="deepspeed", deepspeed=_zero(stage))
    objects = _prepared(dist)
    restored = faccel.restore(dist, objects[4], root)
    view = _zero_view(objects[0])
    ended = _train(dist, objects, restored, until=restored.step + steps, root=root)
    finite = all(torch.isfinite(torch.tensor(p)).all().item() for p in _full_params(dist, objects[0]))
    # Another model's shapes: refused by name before anything is loaded.
    other = _model()
    other_optimizer = torch.optim.AdamW(other.parameters(), lr=0.01)
    x, y = _task()
    raw = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)
    other, other_optimizer, _ = faccel.prepare(dist, other, other_optimizer, raw)
    before = _full_params(dist, other)
    try:
        faccel.restore(dist, faccel.TrainState.create(model=other, optimizer=other_optimizer), root)
        refusal = None
    except faccel.errors.CheckpointError as error:
        refusal = str(error)
    untouched = _full_params(dist, other) == before
    try:
        other_optimizer.state_dict()
        direct = None
    except faccel.errors.UsageError as error:
        direct = str(error)
    try:
        faccel.checkpoint(dist, ended, os.path.join(root, "sharded"), sharded=True)
        sharded = None
    except faccel.errors.ArgumentValueError as error:
        sharded = str(error)
    return {
        "view": view,
        "step": restored.step,
        "ended": ended.step,
        "finite": finite,
        "refusal": refusal,
        "untouched": untouched,
        "state_dict": direct,
        "sharded": sharded,
    }


def _whole(model: Any) -> dict[str, torch.Tensor]:
    """The module's parameters, whole (each ZeRO-3 one gathered through DeepSpeed's own API)."""
    import deepspeed

    out = {}
    for name, param in model.module.named_parameters():
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            out[name] = param.detach().clone()
    return out


def save_model_and_the_rest(*, stage: int, directory: str) -> dict[str, Any]:
    """A tiny GPT-2 trained 2 steps under ZeRO ``stage``: save_model (in shards), load_model back into
    a fresh engine, from_pretrained on rank 0; clip_grad_norm, unwrap_model and gather_for_metrics."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.utils import safe_get_full_fp32_param

    import faccel
    from tests.distributed.save_model_workers import tiny_gpt2

    dist = faccel.detect(strategy="deepspeed", deepspeed=_zero(stage))
    tokens = torch.randint(0, 101, (16, 16), generator=torch.Generator().manual_seed(3))
    raw = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=2)

    def build(seed: int) -> tuple[Any, ...]:
        model = tiny_gpt2(seed)
        return faccel.prepare(dist, model, torch.optim.AdamW(model.parameters(), lr=1e-2), raw)

    model, optimizer, loader = build(0)
    seen, gathered, refusal = [], None, None
    tracker = faccel.init_tracker(dist, os.path.join(directory, f"run{stage}"), config={"stage": stage})
    for number, (batch,) in enumerate(loader.at(epoch=0)):
        loss = model(batch, labels=batch).loss
        faccel.backward(dist, loss)
        faccel.log(dist, tracker, number, {"loss": loss.detach()}, reduce="mean")  # a collective
        if number == 0:
            try:
                faccel.clip_grad_norm(dist, model, 1.0)
            except faccel.errors.UsageError as error:
                refusal = str(error)
            seen = batch[:, 0].tolist()
            gathered = faccel.gather_for_metrics(dist, batch[:, 0], loader, batch=0).tolist()
        optimizer.step()
        optimizer.zero_grad()
        if number == 1:
            break
    try:
        with faccel.uneven_inputs(dist, model):
            pass
        uneven = None
    except faccel.errors.UsageError as error:
        uneven = str(error)
    faccel.end_training(dist, tracker)
    records = Path(directory, f"run{stage}", "metrics.jsonl")
    logged = len(records.read_text().splitlines()) if dist.is_main_process else None
    trained = _whole(model)
    folder = os.path.join(directory, f"zero{stage}")
    faccel.save_model(dist, model, folder, max_shard_size=40_000)
    fresh, _, _ = build(1)
    differed = any(not torch.equal(t, trained[n]) for n, t in _whole(fresh).items())
    faccel.load_model(dist, fresh, folder)
    loaded = _whole(fresh)
    masters = {n: safe_get_full_fp32_param(p) for n, p in fresh.module.named_parameters()}
    result = {
        "unwrapped": faccel.unwrap_model(model) is model.module,
        "logged": logged,
        "refusal": refusal,
        "uneven": uneven,
        "seen": seen,
        "gathered": gathered,
        "differed": differed,
        "loaded": all(torch.equal(loaded[n], t) for n, t in trained.items()),
        "masters": all(torch.equal(masters[n], t) for n, t in trained.items()),
        "files": sorted(os.listdir(folder)),
    }
    if dist.is_main_process:
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(folder)
        state = dict(hf.named_parameters())
        result["from_pretrained"] = all(torch.equal(state[n], t) for n, t in trained.items())
        result["tied"] = hf.lm_head.weight is hf.transformer.wte.weight
        plain = tiny_gpt2(2)
        result["load_model_plain"] = faccel.load_model(faccel.detect({}), plain, folder) == ((), ())
        result["plain_equal"] = all(torch.equal(p, trained[n]) for n, p in plain.named_parameters())
    return result
