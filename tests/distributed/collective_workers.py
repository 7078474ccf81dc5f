"""Functions the two-process collective tests run on every rank (module level, so picklable).

Each returns plain data (lists, strings), never tensors.
"""

from __future__ import annotations

from collections import namedtuple
from typing import Any

import torch

Pair = namedtuple("Pair", ["first", "second"])


def collectives_roundtrip() -> dict[str, Any]:
    """gather, reduce, broadcast, pad_across_processes and gather_object on real peers."""
    import faccel

    dist = faccel.detect()
    r = dist.rank
    rows = 2 + r  # dim-0 sizes differ per rank: 2 on rank 0, 3 on rank 1
    tree = {
        "x": torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * r,
        "pair": Pair(torch.full((rows,), r, dtype=torch.int64), [torch.full((rows, 2), r == 1)]),
        "half": torch.full((rows,), 0.5 + r, dtype=torch.bfloat16),
        "loss": torch.tensor(1.5 + r),
    }
    gathered = faccel.gather(dist, tree)
    reduce_in = {"f": torch.tensor([1.0 + r, -r]), "i": torch.tensor([3 * r, 7]), "h": torch.ones(2).half()}
    floats = {key: value for key, value in reduce_in.items() if value.is_floating_point()}
    reduced = {
        op: faccel.reduce(dist, reduce_in if op != "mean" else floats, op=op) for op in ("sum", "max", "min")
    }
    reduced["mean"] = faccel.reduce(dist, floats, op="mean")
    # Only rank 1 knows the shapes; rank 0's leaves are placeholders.
    sent = (
        (torch.arange(5) * 10, {"m": torch.eye(2, dtype=torch.float64)})
        if r == 1
        else (
            torch.zeros(1),
            {"m": torch.zeros(0)},
        )
    )
    received = faccel.broadcast(dist, sent, src=1)
    seqs = torch.full((2, 1 + 2 * r), r + 1)
    padded = faccel.pad_across_processes(dist, {"s": seqs, "loss": torch.tensor(0.0)}, dim=1, pad_index=-1)
    left = faccel.pad_across_processes(dist, seqs, dim=-1, pad_first=True)
    objects = faccel.gather_object(dist, {"rank": r, "name": f"worker{r}"})
    faccel.wait_for_everyone(dist)
    return {
        "x": gathered["x"].tolist(),
        "pair_type": type(gathered["pair"]).__name__,
        "first": gathered["pair"].first.tolist(),
        "flags": gathered["pair"].second[0].tolist(),
        "flags_dtype": str(gathered["pair"].second[0].dtype),
        "half": gathered["half"].float().tolist(),
        "half_dtype": str(gathered["half"].dtype),
        "loss": gathered["loss"].tolist(),
        "inputs_untouched": reduce_in["f"].tolist() == [1.0 + r, -r],
        "reduced": {op: {key: value.tolist() for key, value in out.items()} for op, out in reduced.items()},
        "reduced_dtypes": {key: str(value.dtype) for key, value in reduced["mean"].items()},
        "received": [received[0].tolist(), received[1]["m"].tolist(), str(received[1]["m"].dtype)],
        "padded": padded["s"].tolist(),
        "padded_loss_shape": list(padded["loss"].shape),
        "left": left.tolist(),
        "objects": objects,
    }


def _attempt(fn: Any) -> str:
    import faccel

    try:
        fn()
    except (
        faccel.errors.DistributedError,
        faccel.errors.ArgumentError,
        faccel.errors.ArgumentValueError,
    ) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def mismatches() -> dict[str, Any]:
    """Each mismatch raises on every rank (no hang), and the group stays usable after it."""
    import faccel

    dist = faccel.detect()
    r = dist.rank
    out = {
        "dtype": _attempt(
            lambda: faccel.gather(dist, {"a": torch.ones(2, dtype=torch.float32 if r else torch.float64)})
        ),
        "trailing": _attempt(lambda: faccel.gather(dist, [torch.ones(2, 3 + r)])),
        "structure": _attempt(
            lambda: faccel.gather(dist, {"a": torch.ones(1)} if r else {"b": torch.ones(1)})
        ),
        "call": _attempt(
            lambda: faccel.gather(dist, torch.ones(1)) if r else faccel.reduce(dist, torch.ones(1), op="sum")
        ),
        "reduce_shape": _attempt(lambda: faccel.reduce(dist, {"g": torch.ones(2 + r)})),
        "reduce_op": _attempt(lambda: faccel.reduce(dist, torch.ones(1), op="avg")),
        "mean_of_ints": _attempt(lambda: faccel.reduce(dist, torch.ones(1, dtype=torch.int32))),
        "broadcast_src": _attempt(lambda: faccel.broadcast(dist, torch.ones(1), src=r)),
        "broadcast_range": _attempt(lambda: faccel.broadcast(dist, torch.ones(1), src=2)),
        "pad_ndim": _attempt(lambda: faccel.pad_across_processes(dist, torch.ones([2] * (1 + r)), dim=0)),
        "not_a_tensor": _attempt(lambda: faccel.gather(dist, {"a": 3})),
        # A description longer than the first exchange buffer takes a second round.
        "big_tree": len(faccel.gather(dist, {f"leaf_{i:04d}": torch.ones(1) for i in range(120)})),
    }
    out["after"] = faccel.gather(dist, torch.tensor([r])).tolist()
    return out


def metrics(sizes: list[int], batch_sizes: list[int], shuffle: bool = False) -> dict[str, Any]:
    """gather_for_metrics over evaluation loaders, per batch and once at the end of the epoch."""
    import faccel

    dist = faccel.detect()
    results: dict[str, Any] = {}
    for n in sizes:
        for b in batch_sizes:
            data = torch.utils.data.TensorDataset(torch.arange(n), torch.arange(n) * 10.0)
            loader = faccel.prepare(dist, torch.utils.data.DataLoader(data, batch_size=b, shuffle=shuffle))
            per_batch, per_batch_indices, outputs = [], [], []
            for k, (index, value) in enumerate(loader):
                prediction = {"index": index, "value": value.unsqueeze(1)}  # an output per sample
                outputs.append(prediction)
                got, indices = faccel.gather_for_metrics(dist, prediction, loader, batch=k, with_indices=True)
                per_batch.append(got["index"].tolist())
                per_batch_indices.append(indices.tolist())
            whole = {key: torch.cat([o[key] for o in outputs]) for key in ("index", "value")}
            at_end = faccel.gather_for_metrics(dist, whole, loader)
            results[f"{n}/{b}"] = {
                "per_batch": [i for batch in per_batch for i in batch],
                "per_batch_indices": [i for batch in per_batch_indices for i in batch],
                "at_end": at_end["index"].tolist(),
                "values": at_end["value"].flatten().tolist(),
                "padding": loader.padding,
            }
    return results


def overhead(repeats: int = 200) -> dict[str, float]:
    """Time per call (µs) of gather with its description exchange, vs a bare all_gather."""
    import time

    import torch.distributed as tdist

    import faccel

    dist = faccel.detect()
    x = {"logits": torch.ones(8, 4), "labels": torch.ones(8, dtype=torch.int64)}
    flat = torch.ones(8 * 4 + 8)
    bare = [torch.empty_like(flat) for _ in range(dist.world_size)]

    def timed(fn: Any) -> float:
        for _ in range(20):
            fn()
        tdist.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1e6

    return {
        "all_gather": timed(lambda: tdist.all_gather(bare, flat)),
        "gather": timed(lambda: faccel.gather(dist, x)),
        "all_gather_object": timed(
            lambda: tdist.all_gather_object([None] * dist.world_size, ("gather", "{}"))
        ),
        "reduce": timed(lambda: faccel.reduce(dist, x["logits"], op="sum")),
        "all_reduce": timed(lambda: tdist.all_reduce(flat)),
    }


def stalled_peer(timeout_s: float = 1.0) -> dict[str, Any]:
    """Rank 1 never joins: rank 0's collective gives up after the process-group timeout."""
    import datetime
    import time

    import faccel

    dist = faccel.detect(timeout=datetime.timedelta(seconds=timeout_s))
    if dist.rank == 1:
        time.sleep(2 * timeout_s)  # stuck (a deadlock, a slow file system), not crashed
        return {"rank": 1}
    start = time.perf_counter()
    try:
        faccel.gather(dist, torch.ones(1))
    except faccel.errors.DistributedError as error:
        return {"rank": 0, "error": str(error), "waited": time.perf_counter() - start}
    return {"rank": 0, "error": None}
