"""Checked checkpoint content into the live objects, and this rank's generators set.

Only :func:`faccel._checkpoint._verify.check` makes a :class:`Loadable`, so
everything loaded here has passed every check first, and every
``load_state_dict`` has already succeeded on a throwaway copy of its object
(``_stage``). The model is loaded last, after every other object took its
state.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch

from faccel._checkpoint._capture import is_stateful
from faccel._checkpoint._format import STATE
from faccel._checkpoint._state_file import Generators, NewRank
from faccel._checkpoint._strategies import strategy_of
from faccel._checkpoint._verify import Loadable
from faccel._loop._strategies import unwrap_model
from faccel._train_state import TrainState
from faccel._tree import paired_leaves, rebuild
from faccel.errors import CheckpointError

__all__ = ["load", "new_rank_seed"]


def new_rank_seed(seed: int, step: int, rank: int) -> int:
    """The seed of a rank the checkpoint has no generators of (restored at a larger world size).

    The first 4 bytes (little-endian) of the SHA-256 of ``"seed:step:rank"``:
    fixed by the run's seed (``DistState.seed``), the checkpoint's step and the
    rank, different for each new rank, and within NumPy's range.

    Example:
        >>> new_rank_seed(0, 7, 2) == new_rank_seed(0, 7, 2) != new_rank_seed(0, 7, 3)
        True
    """
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def _placed(saved: Any, live: Any) -> Any:
    """``saved`` with each tensor moved to the device of the target's tensor at the same place."""
    moved = [
        value.to(target.device)
        if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor)
        else value
        for _, value, target in paired_leaves(saved, live)
    ]
    return rebuild(saved, moved)


def _into(where: str, field: str, obj: Any, saved: Mapping[str, Any]) -> None:
    """``obj.load_state_dict(saved)``; only an object that could not be copied may still refuse."""
    try:
        with torch.no_grad():
            obj.load_state_dict(saved)
    except Exception as error:  # only an object that could not be copied gets here untried
        msg = (
            f"checkpoint {where}: {STATE}: {field}: the saved state does not load into the target "
            f"({type(error).__name__}: {error}); it could not be tried on a copy first, so {field} "
            "may be partly loaded (the objects loaded before it are: fix the target and restore again)"
        )
        raise CheckpointError(msg) from error


def load(state: TrainState, loadable: Loadable, rng: Generators | NewRank | None) -> TrainState:
    """Load a checked checkpoint into ``state``'s objects (in place) and set the generators.

    Returns a new TrainState with the saved step, epoch, position and extras.
    ``rng`` is a :class:`NewRank` for a rank the checkpoint has no generators
    of (restored at a larger world size): its Python, NumPy and torch (and
    CUDA) generators are seeded with :func:`new_rank_seed`.
    """
    where = loadable.where
    extras = _load_extras(state.extras, loadable.extras, where, "extras")
    rank_extras = {}
    if isinstance(rng, Generators):
        rank_extras = _load_extras(state.rank_extras, rng.extras, where, "rank_extras")
    if state.scaler is not None and loadable.scaler:
        _into(where, "scaler", state.scaler, dict(loadable.scaler))
    if state.scheduler is not None and loadable.scheduler is not None:
        _into(where, "scheduler", state.scheduler, dict(loadable.scheduler))
    # The strategy loads its own way where it must (FSDP2 scatters whole tensors into each rank's
    # shards, ZeRO into its partitions: collectives, every rank takes part); else load_state_dict.
    strategy = strategy_of(state.model)
    if not strategy.load(state.model, state.optimizer, loadable.model, loadable.optimizer):
        if state.optimizer is not None:
            _into(where, "optimizer", state.optimizer, dict(loadable.optimizer))
        _into(where, "model", unwrap_model(state.model), dict(loadable.model))  # strict: every key, checked
    if isinstance(rng, NewRank):
        seed = new_rank_seed(rng.seed, loadable.step, rng.rank)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)  # CUDA's generators too
    elif rng is not None:
        random.setstate(rng.python)
        np.random.set_state(rng.numpy)
        torch.set_rng_state(rng.torch)
        if rng.cuda is not None:
            torch.cuda.set_rng_state_all(rng.cuda)
    restored = attrs.evolve(
        state,
        step=loadable.step,
        epoch=loadable.epoch,
        position=loadable.position,
        resumed_at=loadable.resumed_at,
        extras=extras,
        rank_extras=rank_extras,
    )
    if restored.loader is not None and restored.consumed:
        # The batch-counting at(epoch, start) would read the epoch again from its start.
        restored.loader.expect_resume(restored.epoch, restored.consumed)
    return restored


def _load_extras(
    live_extras: Mapping[str, Any], saved: Mapping[str, Any], where: str, label: str
) -> dict[str, Any]:
    """Stateful extras loaded in place, the others replaced by the saved values."""
    extras: dict[str, Any] = {}
    for name, live in live_extras.items():
        value = saved[name]
        if is_stateful(live):
            _into(where, f"{label}[{name!r}]", live, _placed(value, live.state_dict()))
            extras[name] = live
        else:
            extras[name] = _placed(value, live)
    return extras
