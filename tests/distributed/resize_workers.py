"""What the resume-at-another-world-size tests run on every rank.

Phase one trains part of an epoch at one world size and checkpoints; phase two
restores at another world size and finishes the epoch. Every rank returns the
dataset indices it read, so the test can check that, across both phases, each
sample of the epoch was read exactly once (plus the padding the loader reports).
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

from tests.distributed.workers import Blocks

SAMPLES = 26


def _objects(dist: Any, batch_size: int, drop_last: bool = False) -> tuple[Any, Any]:
    import faccel

    generator = torch.Generator().manual_seed(3)
    x, y = torch.randn(SAMPLES, 8, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    data = torch.utils.data.TensorDataset(torch.arange(SAMPLES), x, y)
    torch.manual_seed(0)
    model = Blocks()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.85, 0.99))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True, drop_last=drop_last)
    model, optimizer, scheduler, loader = faccel.prepare(dist, model, optimizer, scheduler, loader)
    state = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler, loader=loader)
    return state, loader


def _digest(state: Any) -> str:
    """SHA-256 of the whole model and optimizer state (gathered from shards), the same at any world size."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    import faccel

    model = faccel.unwrap_model(state.model)
    model_state, optimizer_state = get_state_dict(
        model, state.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    h = hashlib.sha256()

    def feed(value: Any) -> None:
        if hasattr(value, "full_tensor"):
            value = value.full_tensor()
        if isinstance(value, torch.Tensor):
            h.update(str((value.dtype, tuple(value.shape))).encode())
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                h.update(str(key).encode())
                feed(value[key])
        elif isinstance(value, list | tuple):
            for item in value:
                feed(item)
        else:
            h.update(repr(value).encode())

    feed(model_state)
    feed(optimizer_state)
    h.update(repr(state.scheduler.state_dict()).encode())
    return h.hexdigest()


def _step(dist: Any, state: Any, batch: Any) -> Any:
    import attrs

    import faccel

    _, inputs, targets = batch
    state.optimizer.zero_grad()
    faccel.backward(dist, torch.nn.functional.mse_loss(state.model(inputs), targets))
    state.optimizer.step()
    state.scheduler.step()
    return attrs.evolve(state, step=state.step + 1, position=state.position + 1)


def interrupted(
    root: str, strategy: str, stop: int, batch_size: int = 2, drop_last: bool = False
) -> dict[str, Any]:
    """Read ``stop`` batches of epoch 0 (after one whole epoch), checkpoint, draw a random number."""
    import attrs

    import faccel

    dist = faccel.detect(strategy=strategy)
    state, loader = _objects(dist, batch_size, drop_last)
    for batch in loader.at(epoch=0):  # a whole epoch first: the interrupted one is epoch 1
        state = _step(dist, state, batch)
    state = attrs.evolve(state, epoch=1, position=0)
    seen: list[int] = []
    for batch in loader.resume(state):
        seen += batch[0].tolist()
        state = _step(dist, state, batch)
        if state.position == stop:
            break
    faccel.checkpoint(dist, state, root)
    return {
        "seen": seen,
        "digest": _digest(state),
        "lr": state.optimizer.param_groups[0]["lr"],
        "draw": torch.rand(1).item(),  # from the generators the checkpoint saved
        "seed": dist.seed,
        "step": state.step,
    }


def resumed(
    root: str, strategy: str, batch_size: int = 2, again: str | None = None, drop_last: bool = False
) -> dict[str, Any]:
    """Restore at this world size, check what came back, and read the rest of the epoch.

    ``again``: a second checkpoint root, written after the first batch of the resumed epoch
    (a checkpoint inside an epoch that was itself resumed at another world size).
    """
    import attrs

    import faccel

    dist = faccel.detect(strategy=strategy)
    state, loader = _objects(dist, batch_size, drop_last)
    state = faccel.restore(dist, state, root)
    result: dict[str, Any] = {
        "digest": _digest(state),
        "lr": state.optimizer.param_groups[0]["lr"],
        "draw": torch.rand(1).item(),
        "epoch_position_consumed": [state.epoch, state.position, state.consumed],
    }
    try:  # the batch-counting form would read the epoch again from its start
        list(loader.at(epoch=state.epoch, start=state.position))
        result["old_form"] = ""
    except faccel.errors.UsageError as error:
        result["old_form"] = str(error)
    view = loader.resume(state)
    result["padding"] = view.padding
    seen: list[int] = []
    for batch in view:
        seen += batch[0].tolist()
        state = _step(dist, state, batch)
        if again is not None and state.position == 1:
            faccel.checkpoint(dist, state, again)
            result["before_again"] = list(seen)
    result["seen"] = seen
    result["finite"] = all(
        bool(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all())
        for p in state.model.parameters()
    )
    state = attrs.evolve(state, epoch=state.epoch + 1, position=0)
    result["next_epoch_batches"] = len(list(loader.resume(state)))  # the next epoch is a plain one
    return result


def unshared_folders(base: str) -> dict[str, Any]:
    """Each rank checkpoints into and restores from its own folder, as nodes with local disks would."""
    import os
    import shutil

    import faccel

    dist = faccel.detect()
    state, _ = _objects(dist, 2)
    mine = f"{base}/node{dist.rank}"
    result: dict[str, Any] = {}
    try:
        faccel.checkpoint(dist, state, mine)
        result["checkpoint"] = ""
    except faccel.errors.CheckpointError as error:
        result["checkpoint"] = str(error)
    result["left"] = sorted(os.listdir(mine)) if os.path.isdir(mine) else None
    faccel.checkpoint(dist, state, f"{base}/shared")  # a real one, then on one "node" only
    if dist.rank == 0:
        shutil.rmtree(mine, ignore_errors=True)
        shutil.copytree(f"{base}/shared", mine)
    faccel.wait_for_everyone(dist)
    before = _digest(state)
    try:
        faccel.restore(dist, state, mine)
        result["restore"] = ""
    except faccel.errors.CheckpointError as error:
        result["restore"] = str(error)
    result["unchanged"] = _digest(state) == before
    return result
