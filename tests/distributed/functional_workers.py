"""Functions the two-process functional-training tests run on every rank (module level: picklable)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch

from tests.distributed.workers import seed_model, seed_task

ROOT = Path(__file__).resolve().parents[2]


def _ddp_run(dist: Any, opt_name: str, kwargs: dict, steps: int) -> list[list[float]]:
    """The DDP path: prepare + faccel.backward + torch.optim."""
    import faccel

    x, y = seed_task()
    model = seed_model()
    cls = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}[opt_name]
    optimizer = cls(model.parameters(), foreach=False, **kwargs)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, loader)
    done = 0
    for epoch in range(steps):
        for inputs, targets in loader.at(epoch=epoch):
            optimizer.zero_grad()
            faccel.backward(dist, torch.nn.functional.mse_loss(model(inputs), targets))
            optimizer.step()
            done += 1
            if done == steps:
                return [p.detach().flatten().tolist() for p in faccel.unwrap_model(model).parameters()]
    raise AssertionError("not enough batches")


def _functional_run(dist: Any, opt_name: str, kwargs: dict, steps: int) -> list[list[float]]:
    """The functional path: model_params + loss_and_grad + sync_grads + pure optimizer."""
    import faccel

    x, y = seed_task()
    model = seed_model()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=True)
    model, loader = faccel.prepare(dist, model, loader)
    params, buffers = faccel.func.model_params(dist, model, will_sync_grads=True)
    optimizer = {"sgd": faccel.func.sgd, "adamw": faccel.func.adamw}[opt_name](**kwargs)
    state = faccel.func.FunctionalState.create(params=params, buffers=buffers, optimizer=optimizer)
    grad_fn = faccel.func.loss_and_grad(dist, faccel.unwrap_model(model), torch.nn.functional.mse_loss)
    for epoch in range(steps):
        for inputs, targets in loader.at(epoch=epoch):
            _, grads = grad_fn(state.params, state.buffers, inputs, targets)
            state = state.apply_gradients(faccel.func.sync_grads(dist, grads))
            if state.step == steps:
                return [p.flatten().tolist() for p in state.params.values()]
    raise AssertionError("not enough batches")


def functional_vs_ddp(configs: list[tuple[str, dict]], steps: int) -> dict[str, Any]:
    """Both paths for each optimizer configuration, plus the guards under a real group."""
    import torch.distributed as tdist

    import faccel
    from faccel.errors import DistributedError

    dist = faccel.detect()
    results = [
        {"ddp": _ddp_run(dist, name, kwargs, steps), "functional": _functional_run(dist, name, kwargs, steps)}
        for name, kwargs in configs
    ]

    guards = {}
    prepared = faccel.prepare(dist, seed_model())
    try:
        faccel.func.model_params(dist, prepared)
        guards["model_params"] = "no error"
    except DistributedError as error:
        guards["model_params"] = str(error)
    try:
        faccel.func.loss_and_grad(dist, prepared, torch.nn.functional.mse_loss)
        guards["loss_and_grad"] = "no error"
    except DistributedError as error:
        guards["loss_and_grad"] = str(error)

    # What the guards prevent: torch.func through the DDP module trains on local gradients.
    x, y = seed_task()
    shard = slice(dist.rank * 8, dist.rank * 8 + 8)
    params = dict(prepared.named_parameters())

    def loss(p: dict) -> torch.Tensor:
        out = torch.func.functional_call(prepared, p, (x[shard],))
        return torch.nn.functional.mse_loss(out, y[shard])

    local = torch.func.grad(loss)(params)["module.0.weight"]
    gathered = [torch.empty_like(local) for _ in range(dist.world_size)]
    tdist.all_gather(gathered, local)
    return {
        "rank": dist.rank,
        "results": results,
        "guards": guards,
        "ddp_func_grads_equal_across_ranks": bool(torch.equal(gathered[0], gathered[1])),
    }


def _grad_tree(rank: int) -> Any:
    """A gradient tree with several dtypes, shapes (0-d, empty) and containers, rank-dependent."""
    import faccel

    g = torch.Generator().manual_seed(100 + rank)
    state = faccel.func.SGDState(momentum_buffer={"m": torch.randn(3, 2, generator=g)}, step=7)
    return {
        "w": torch.randn(5, 4, generator=g),
        "b": torch.randn((), generator=g),
        "empty": torch.randn(0, 3, generator=g),
        "t": torch.randn(4, 3, generator=g).t(),  # not contiguous
        "f64": [torch.randn(7, generator=g, dtype=torch.float64), None],
        "bf16": (torch.randn(6, generator=g).to(torch.bfloat16),),
        "record": state,
    }


def sync_grads_vs_per_tensor() -> dict[str, Any]:
    """sync_grads (one bucket per dtype, and small buckets) against per-tensor all_reduce."""
    import torch.utils._pytree as pytree

    import faccel

    dist = faccel.detect()
    grads = _grad_tree(dist.rank)

    def tensors(tree: Any) -> list[torch.Tensor]:
        return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]

    before = [t.clone() for t in tensors(grads)]
    reference = []
    for t in tensors(grads):
        t = t / dist.world_size  # divide first, as DDP and sync_grads do
        torch.distributed.all_reduce(t)
        reference.append(t)
    out: dict[str, Any] = {"rank": dist.rank}
    for label, cap in (("one_bucket", None), ("capped", 40 / 2**20)):
        synced = faccel.func.sync_grads(dist, grads, bucket_cap_mb=cap)
        leaves = tensors(synced)
        out[label] = {
            "same_structure": pytree.tree_structure(synced) == pytree.tree_structure(grads),
            "static_kept": synced["record"].step == 7 and synced["f64"][1] is None,
            "equal": all(torch.equal(a, b) for a, b in zip(leaves, reference, strict=True)),
            "dtypes": [str(t.dtype) for t in leaves] == [str(t.dtype) for t in reference],
        }
    for label, cap in (("reused_one_bucket", None), ("reused_capped", 40 / 2**20)):
        buckets = faccel.func.grad_buckets(dist, grads, bucket_cap_mb=cap)
        first = faccel.func.sync_grads(dist, grads, buckets=buckets)
        second = faccel.func.sync_grads(dist, grads, buckets=buckets)
        # Passed back in, a result is this bucket's own memory: the aliasing path. Its
        # values are equal on both ranks, so their average is themselves (x/2 + x/2 == x).
        third = faccel.func.sync_grads(dist, second, buckets=buckets)
        out[label] = {
            "equal": all(torch.equal(a, b) for a, b in zip(tensors(second), reference, strict=True)),
            "reused": all(
                a.data_ptr() == b.data_ptr() for a, b in zip(tensors(first), tensors(second), strict=True)
            ),
            "in_buffers": {t.untyped_storage().data_ptr() for t in tensors(second) if t.numel()}
            <= {b.untyped_storage().data_ptr() for b in buckets.buffers},
            "round_trip": all(torch.equal(a, b) for a, b in zip(tensors(third), reference, strict=True)),
            "static_kept": third["record"].step == 7 and third["f64"][1] is None,
        }
    # A previous result passed back permuted: "w2" and "w" swap places (same shape), and with
    # a 40-byte cap they sit in different buckets, one reduced while the other is copied.
    buckets = faccel.func.grad_buckets(dist, {"w": grads["w"], "w2": grads["w"]}, bucket_cap_mb=40 / 2**20)
    prev = faccel.func.sync_grads(dist, {"w": grads["w"], "w2": 2 * grads["w"]}, buckets=buckets)
    want_w, want_w2 = prev["w"].clone(), prev["w2"].clone()
    swapped = faccel.func.sync_grads(dist, {"w": prev["w2"], "w2": prev["w"]}, buckets=buckets)
    out["swapped_back"] = torch.equal(swapped["w"], want_w2) and torch.equal(swapped["w2"], want_w)
    misfits = {
        "shape": (grads, dict(grads, w=torch.zeros(4, 5))),
        "tensor_where_none": ({"a": None, "b": grads["w"]}, {"a": grads["w"], "b": grads["w"]}),
        "other_world": (grads, grads),
        "keys": ({"w": grads["w"], "b": grads["b"]}, {"w": grads["w"], "bias": grads["b"]}),
    }
    # A tree without tensors has nothing to average, with buckets or without.
    out["no_tensors"] = faccel.func.sync_grads(
        dist, {"a": None}, buckets=faccel.func.grad_buckets(dist, {"a": None})
    )
    out["misfit"] = {}
    for label, (like, given) in misfits.items():
        maker = faccel.detect({}) if label == "other_world" else dist
        try:
            faccel.func.sync_grads(dist, given, buckets=faccel.func.grad_buckets(maker, like))
            out["misfit"][label] = "no error"
        except faccel.errors.FunctionalError as error:
            out["misfit"][label] = str(error)
    out["input_untouched"] = all(torch.equal(a, b) for a, b in zip(tensors(grads), before, strict=True))
    # A dict of tensors takes the fast path: check it too, with a cap that makes three buckets.
    flat = {name: t for name, t in grads.items() if isinstance(t, torch.Tensor)}
    synced = faccel.func.sync_grads(dist, flat, bucket_cap_mb=64 / 2**20)
    want = {name: r for name, r in zip(("w", "b", "empty", "t"), reference, strict=False)}
    out["dict_equal"] = list(synced) == list(flat) and all(torch.equal(synced[k], want[k]) for k in want)
    return out


def load_example(name: str) -> Any:
    """``examples/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"example_{name}", ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def functional_seed_example(epochs: int) -> dict[str, Any]:
    """examples/functional_seed.py's training on this rank: its last loss and final parameters."""
    import faccel

    dist = faccel.detect()
    loss, state = load_example("functional_seed").train(dist, epochs)
    return {"loss": loss, "step": state.step, "params": [p.flatten().tolist() for p in state.params.values()]}
