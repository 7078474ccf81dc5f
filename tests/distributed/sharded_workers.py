"""What the sharded-checkpoint tests run on every rank: save at one world size, load at another.

Every function compares *global* state: each model tensor and each optimizer
state tensor whole (``full_tensor()`` of a DTensor), as a SHA-256 of its
dtype, shape and bytes, keyed as the checkpoint keys them (``model/<name>``,
``optimizer/state.<index>.<key>``), so a restore at any world size and any
sharding can be compared with the state that was saved, bit for bit.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from tests.distributed.workers import Blocks, seed_task


def _digest(tensor: torch.Tensor) -> str:
    if type(tensor).__name__ == "DTensor":
        tensor = tensor.full_tensor()  # type: ignore[attr-defined]
    tensor = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{tensor.dtype} {list(tensor.shape)}".encode())
    h.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def global_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Digests of every model and optimizer tensor, whole, plus the hyperparameters (a collective)."""
    import faccel

    inner = faccel.unwrap_model(model)
    out: dict[str, Any] = {f"model/{name}": _digest(t) for name, t in inner.state_dict().items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):
        for key, value in optimizer.state.get(param, {}).items():
            out[f"optimizer/state.{index}.{key}"] = _digest(value)
    out["groups"] = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in group.items() if k != "params"}
        for group in optimizer.param_groups
    ]
    return out


def _trained(dist: Any, steps: int, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    import faccel

    x, y = seed_task(n=48)
    torch.manual_seed(seed)
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.8, 0.95))
    model, optimizer = faccel.prepare(dist, model, optimizer)
    share = 48 // dist.world_size
    mine = slice(dist.rank * share, dist.rank * share + share)
    for _ in range(steps):
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(x[mine]), y[mine]))
        optimizer.step()
    return model, optimizer


def save(root: str, strategy: str = "fsdp", sharded: bool | None = None, steps: int = 3) -> dict[str, Any]:
    """Train Blocks + AdamW, checkpoint at an epoch boundary; the global state and the files written."""
    import attrs

    import faccel

    dist = faccel.detect(strategy=strategy)
    model, optimizer = _trained(dist, steps)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    folder = faccel.checkpoint(dist, attrs.evolve(state, step=steps, epoch=1), root, sharded=sharded)
    return {
        "state": global_state(model, optimizer),
        "files": {p.name: p.stat().st_size for p in sorted(Path(folder).iterdir())},
    }


def load(root: str, strategy: str = "fsdp") -> dict[str, Any]:
    """Fresh Blocks + AdamW (other values, other hyperparameters), restored: the global state."""
    import faccel

    dist = faccel.detect(strategy=strategy)
    torch.manual_seed(11)
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    try:
        restored = faccel.restore(dist, state, root)
    except faccel.errors.CheckpointError as error:
        return {"error": str(error), "state": global_state(model, optimizer)}
    return {
        "state": global_state(model, optimizer),
        "step": restored.step,
        "param_types": sorted({type(p).__name__ for p in model.parameters()}),
    }


def read_whole(root: str) -> dict[str, Any]:
    """Read a sharded checkpoint's tensors whole at this world size, as any replicated target does
    (what a DDP rank reads), without loading: their digests."""
    import faccel
    from faccel._checkpoint._restore import _read_manifest
    from faccel._checkpoint._sharded._flow import read_tensors
    from faccel._checkpoint._state_file import StateFile
    from faccel._storage._durable import read_json

    dist = faccel.detect()
    folder = faccel.latest_checkpoint(root)
    assert folder is not None
    torch.manual_seed(11)
    plain = Blocks()
    state = faccel.TrainState.create(model=plain, optimizer=torch.optim.AdamW(plain.parameters()))
    records, world, version = _read_manifest(folder, faccel.detect({}), plain)
    content = StateFile.decode(read_json(folder / "state.json", where="state.json"), where="state.json")
    tensors, _ = read_tensors(folder, records, world, state, content, where=str(folder))
    out = {f"model/{k}": _digest(v) for k, v in tensors["model.safetensors"].items()}
    out |= {f"optimizer/{k}": _digest(v) for k, v in tensors["optimizer.safetensors"].items()}
    return {"rank": dist.rank, "version": version, "world": world, "digests": out}


def load_tensor_parallel(root: str, layout: str, victim: int | None = None) -> dict[str, Any]:
    """Restore into fresh Blocks + AdamW under ``layout`` (tensor parallelism of 2): ``inp``
    column-parallel (its weight and bias split by rows), ``out`` row-parallel (its weight split by
    columns), the rest as the layout's data-parallel part makes it. With ``victim``, rank 0 first
    flips a byte of ``inp.weight`` in that rank's shard file."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    import faccel

    dist = faccel.detect(layout=layout)
    if victim is not None:
        _corrupt(dist, root, victim, "model/inp.weight")
    torch.manual_seed(11)
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.5)
    plan = {
        "inp": ColwiseParallel(output_layouts=Replicate()),
        "out": RowwiseParallel(input_layouts=Replicate()),
    }
    model, optimizer = faccel.prepare(dist, model, optimizer, tp_plan=plan)
    placements = {name: str(getattr(p, "placements", None)) for name, p in model.named_parameters()}
    tensor_rank = dist.parallel.coordinate("tensor", dist.rank)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    try:
        faccel.restore(dist, state, root)
    except faccel.errors.CheckpointError as error:
        return {"error": str(error), "placements": placements, "tensor": tensor_rank}
    return {"state": global_state(model, optimizer), "placements": placements, "tensor": tensor_rank}


def _corrupt(dist: Any, root: str, victim: int, key: str) -> None:
    """Rank 0 flips the first byte of ``key``'s chunk in ``victim``'s shard file; every rank waits."""
    import faccel
    from faccel._storage._safetensors import read_header

    folder = faccel.latest_checkpoint(root)
    assert folder is not None
    if dist.rank == 0:
        path = folder / f"shard-{victim:05d}.safetensors"
        header = read_header(path, where=str(path))
        offset = header.data_start + header.tensors[key].start
        with open(path, "r+b") as handle:
            handle.seek(offset)
            byte = handle.read(1)
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
    torch.distributed.barrier()


def corrupt_and_load(root: str, victim: int, key: str = "model/inp.weight") -> dict[str, Any]:
    """Rank 0 flips the first byte of ``key``'s chunk in ``victim``'s shard file; every rank restores."""
    import faccel

    _corrupt(faccel.detect(strategy="fsdp"), root, victim, key)
    return load(root)


def background_save(root: str, fail_on: int | None = None) -> dict[str, Any]:
    """checkpoint(..., blocking=False), then 3 more FSDP2 steps (collectives) while it is written;
    then a restore into fresh objects (which waits for it). ``fail_on``: that rank's shard write fails."""
    import attrs

    import faccel
    from faccel._checkpoint import _jobs

    dist = faccel.detect(strategy="fsdp")
    model, optimizer = _trained(dist, 3)
    saved = global_state(model, optimizer)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    if dist.rank == fail_on:

        def full_disk(*args: object, **kwargs: object) -> Any:
            raise OSError(28, "No space left on device")

        _jobs.write_shard = full_disk  # type: ignore[assignment]  # this child process only
    faccel.checkpoint(dist, attrs.evolve(state, step=3, epoch=1), root, blocking=False)
    x, y = seed_task(n=48)
    for _ in range(3):  # training goes on, with FSDP2's collectives, while the checkpoint is written
        optimizer.zero_grad()
        faccel.backward(dist, torch.nn.functional.mse_loss(model(x[:8]), y[:8]))
        optimizer.step()
    after = global_state(model, optimizer)
    loaded = load(root)
    return {"saved": saved, "after": after, "loaded": loaded}
