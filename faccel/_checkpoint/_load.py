"""Checked checkpoint content into the live objects, and this rank's generators set.

Only :func:`faccel._checkpoint._verify.check` makes a :class:`Loadable`, so
everything loaded here has passed every check first.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import attrs
import numpy as np
import torch

from faccel._checkpoint._capture import is_stateful
from faccel._checkpoint._sharded_state import load_full_state
from faccel._checkpoint._verify import Loadable
from faccel._model import is_sharded, unwrap_model
from faccel._train_state import TrainState
from faccel._tree import paired_leaves, rebuild

__all__ = ["load"]


def _placed(saved: Any, live: Any) -> Any:
    """``saved`` with each tensor moved to the device of the target's tensor at the same place."""
    moved = [
        value.to(target.device)
        if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor)
        else value
        for _, value, target in paired_leaves(saved, live)
    ]
    return rebuild(saved, moved)


def load(state: TrainState, loadable: Loadable, rng: Mapping[str, Any] | None) -> TrainState:
    """Load a checked checkpoint into ``state``'s objects (in place) and set the generators.

    Returns a new TrainState with the saved step, epoch, position and extras.
    ``rng`` is None for a rank the checkpoint has no generators of (resharding
    to more ranks): its generators are left as they are.
    """
    model = unwrap_model(state.model)
    if is_sharded(model):
        # A collective: every rank scatters the whole tensors into its own shards.
        load_full_state(model, state.optimizer, loadable.model, loadable.optimizer)
    else:
        with torch.no_grad():
            model.load_state_dict(dict(loadable.model), strict=True)
        if state.optimizer is not None:
            state.optimizer.load_state_dict(dict(loadable.optimizer))
    if state.scheduler is not None and loadable.scheduler is not None:
        state.scheduler.load_state_dict(dict(loadable.scheduler))
    if state.scaler is not None and loadable.scaler:
        state.scaler.load_state_dict(dict(loadable.scaler))
    extras = _load_extras(state.extras, loadable.extras)
    rank_extras = _load_extras(state.rank_extras, rng["extras"]) if rng is not None else {}
    if rng is not None:
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state_all(rng["cuda"])
    return attrs.evolve(
        state,
        step=loadable.step,
        epoch=loadable.epoch,
        position=loadable.position,
        extras=extras,
        rank_extras=rank_extras,
    )


def _load_extras(live_extras: Mapping[str, Any], saved: Mapping[str, Any]) -> dict[str, Any]:
    """Stateful extras loaded in place, the others replaced by the saved values."""
    extras: dict[str, Any] = {}
    for name, live in live_extras.items():
        value = saved[name]
        if is_stateful(live):
            live.load_state_dict(_placed(value, live.state_dict()))
            extras[name] = live
        else:
            extras[name] = _placed(value, live)
    return extras
