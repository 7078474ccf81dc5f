"""What the tests of a peer dying during a checkpoint's whole-state gather run on every rank.

Rank 1 ends its process (``os._exit``, no cleanup, as a kill would) at the moment it would
gather: at the entry of the function that gathers (torch's ``get_state_dict`` for FSDP2,
DeepSpeed's ``safe_get_full_optimizer_state`` for ZeRO-1/2), which the survivor has already
entered. Rank 0 returns what the user sees: the error's type and message.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch

from tests.distributed.peer_workers import _outcome


def _die(*args: Any, **kwargs: Any) -> Any:
    os._exit(0)


def peer_dies_in_the_gather(root: str, strategy: str, timeout_s: float, stage: int = 2) -> dict[str, Any]:
    """Both ranks trained one step; rank 1 dies entering the gather of ``checkpoint(..., sharded=False)``."""
    import attrs

    import faccel

    timeout = datetime.timedelta(seconds=timeout_s)
    if strategy == "deepspeed":
        from tests.distributed import deepspeed_workers as dw

        os.environ["DS_ACCELERATOR"] = "cpu"
        dist = faccel.detect(strategy="deepspeed", deepspeed=dw._zero(stage), timeout=timeout)
        objects = dw._prepared(dist)
        state = dw._train(dist, objects, objects[4], until=1, root=root)
        if dist.rank == 1:
            import deepspeed.utils

            deepspeed.utils.safe_get_full_optimizer_state = _die  # type: ignore[assignment]
    else:
        from tests.distributed.sharded_workers import _trained

        dist = faccel.detect(strategy=strategy, timeout=timeout)
        model, optimizer = _trained(dist, 1)
        state = attrs.evolve(faccel.TrainState.create(model=model, optimizer=optimizer), step=1)
        if dist.rank == 1:
            import torch.distributed.checkpoint.state_dict as state_dict

            state_dict.get_state_dict = _die  # type: ignore[assignment]
    torch.manual_seed(0)
    return _outcome(lambda: faccel.checkpoint(dist, state, root, sharded=False))


def checkpoint_until_killed(root: str, out: str, stage: int, timeout_s: float) -> None:
    """A DeepSpeed run of 2 ranks: one step trained, then a checkpoint step after step (``keep=2``)
    until one rank is killed. Each rank writes ``ready-RANK`` (the first checkpoint's seconds) after
    its first checkpoint, and, when a checkpoint raises, ``outcome-RANK.json`` (the error's type,
    whether faccel names it, its message); then it ends its process at once (no teardown of a
    process group whose peer is gone)."""
    import json
    import time

    import attrs

    import faccel
    from tests.distributed import deepspeed_workers as dw

    os.environ["DS_ACCELERATOR"] = "cpu"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist = faccel.detect(strategy="deepspeed", deepspeed=dw._zero(stage), timeout=timeout)
    objects = dw._prepared(dist)
    state = dw._train(dist, objects, objects[4], until=1, root=root)
    folder = os.path.join(out, f"outcome-{dist.rank}.json")
    try:
        for step in range(state.step, state.step + 100_000):
            start = time.monotonic()
            faccel.checkpoint(dist, attrs.evolve(state, step=step), root, keep=2, arrival_timeout=timeout)
            if step == state.step:
                with open(os.path.join(out, f"ready-{dist.rank}"), "w") as ready:
                    ready.write(str(time.monotonic() - start))
    except BaseException as error:  # what the survivor of a kill sees: the test asserts it is named
        outcome = {
            "error": type(error).__name__,
            "named": isinstance(error, faccel.errors.FaccelError),
            "message": str(error)[:2000],
        }
        with open(folder + ".tmp", "w") as file:
            json.dump(outcome, file)
        os.replace(folder + ".tmp", folder)
    os._exit(0)


def restore_each(roots: list[str], stage: int) -> list[dict[str, Any]]:
    """One process: each root's latest checkpoint restored into a fresh ZeRO ``stage`` engine; for
    each, the step restored, or the error, and any warning (a latest passed over as broken)."""
    import warnings

    import faccel
    from tests.distributed import deepspeed_workers as dw

    os.environ["DS_ACCELERATOR"] = "cpu"
    dist = faccel.detect(strategy="deepspeed", deepspeed=dw._zero(stage))
    objects = dw._prepared(dist)
    found = []
    for root in roots:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                step, error = faccel.restore(dist, objects[4], root).step, None
            except Exception as failure:  # counted: a bad restore
                step, error = None, f"{type(failure).__name__}: {failure}"
        passed_over = [
            str(w.message) for w in caught if issubclass(w.category, faccel.errors.CheckpointWarning)
        ]
        found.append({"step": step, "error": error, "warnings": passed_over})
    return found


def peer_dies_in_a_deepspeed_step(where: str, timeout_s: float, out: str) -> None:
    """ZeRO-2 on 2 ranks, one step trained; rank 1 dies entering the engine's ``where`` ("backward" or
    "step") of the second, which the survivor runs (its collectives are DeepSpeed's own). The survivor
    writes what it saw to ``out/outcome.json`` and ends its process at once (a teardown of a group
    whose peer is gone can wait out gloo's timeout)."""
    import json

    import faccel
    from tests.distributed import deepspeed_workers as dw

    os.environ["DS_ACCELERATOR"] = "cpu"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist = faccel.detect(strategy="deepspeed", deepspeed=dw._zero(2), timeout=timeout)
    objects = dw._prepared(dist)
    model, optimizer, _, _, state = objects
    dw._train(dist, objects, state, until=1, root="")
    if dist.rank == 1:
        object.__setattr__(model, where, _die)
    x, y = dw._task()

    def step() -> None:
        faccel.backward(dist, torch.nn.functional.mse_loss(model(x[:4]), y[:4]))
        optimizer.step()

    outcome = _outcome(step)
    with open(os.path.join(out, "outcome.json.tmp"), "w") as file:
        json.dump(outcome, file)
    os.replace(os.path.join(out, "outcome.json.tmp"), os.path.join(out, "outcome.json"))
    os._exit(0)
