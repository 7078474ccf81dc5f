"""What the object-storage tests run in worker processes: each first points s3fs at the test's server.

Workers come from a forkserver started before the test set its environment, so
every function takes the environment (endpoint, dummy credentials) and sets it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from tests.distributed import checkpoint_workers as cw
from tests.distributed import sharded_workers as sw
from tests.object_store import use


def save(env: Mapping[str, str], root: str, strategy: str, sharded: bool | None, steps: int = 3) -> dict:
    """Train Blocks + AdamW on every rank, checkpoint into ``root`` (a URL): the global state, the objects."""
    import attrs

    import faccel

    use(env)
    dist = faccel.detect(strategy=strategy)
    model, optimizer = sw._trained(dist, steps)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    folder = faccel.checkpoint(dist, attrs.evolve(state, step=steps, epoch=1), root, sharded=sharded)
    import fsspec

    fs, key = fsspec.core.url_to_fs(str(folder))
    fs.invalidate_cache()
    return {
        "state": sw.global_state(model, optimizer),
        "objects": sorted(p.rsplit("/", 1)[1] for p in fs.ls(key)),
    }


def load(env: Mapping[str, str], root: str, strategy: str) -> dict:
    """Fresh Blocks + AdamW restored from ``root``: the global state."""
    use(env)
    return sw.load(root, strategy)


def crash_trials(
    env: Mapping[str, str], root: str, trials: int, delay_in_writes: float, seed: int, sharded: bool = False
) -> dict[str, Any]:
    """Fork writers that checkpoint step after step into ``root``; SIGKILL each at a random moment;
    restore. ``[committed, restored]`` per trial; raises if a restore fails or mixes two checkpoints."""
    import faccel

    use(env)
    dist = faccel.detect({})
    state = cw.crash_state(0)
    faccel.checkpoint(dist, cw.at_step(state, 0, mark=0), root, sharded=sharded)
    faccel.checkpoint(dist, state, f"{root}-warmup", sharded=sharded)  # one-time costs, before any kill

    def write(mark: int) -> None:
        faccel.checkpoint(dist, cw.at_step(state, mark), root, keep=2, sharded=sharded)

    torch.set_num_threads(1)
    outcomes = cw.kill_loop(
        write, lambda: cw.crash_check(root), trials=trials, delay_in_writes=delay_in_writes, seed=seed
    )
    # What the kills left: at most one uncommitted step prefix beyond the committed ones, never a
    # committed one without all of its objects (the restores above checked each).
    import fsspec

    fs, key = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    return {"outcomes": outcomes, "left": sorted(p.rsplit("/", 1)[1] for p in fs.ls(key)), "pid": os.getpid()}
