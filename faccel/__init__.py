"""faccel: a plain PyTorch loop on any device, process count and precision, checkpointed exactly.

Pure functions over frozen records: :func:`detect` gives a :class:`DistState`,
:func:`prepare` readies models, optimizers and loaders for it, and
:func:`backward` runs the right backward pass.

Every public name is imported on first use (PEP 562): ``import faccel`` costs
next to nothing beside ``import torch``, and a script pays only for the parts
it uses. ``__all__`` is the public surface.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the same names, for type checkers and IDEs
    from faccel import errors
    from faccel._accumulate import MicroStep, accumulate, micro_batches, micro_step
    from faccel._backward import backward
    from faccel._checkpoint import checkpoint, latest_checkpoint, restore
    from faccel._clip import clip_grad_norm, clip_grad_value
    from faccel._collectives import broadcast, gather, gather_object, pad_across_processes, reduce
    from faccel._data import PreparedLoader, to_device
    from faccel._functional import FunctionalState, loss_and_grad, model_params
    from faccel._grad_sync import GradBuckets, grad_buckets, sync_grads
    from faccel._launch import LaunchInfo, parse_launch
    from faccel._logging import RankLogger, get_logger
    from faccel._metrics import gather_for_metrics
    from faccel._model import unwrap_model
    from faccel._optim import AdamWState, SGDState, adamw, sgd
    from faccel._precision import autocast, grad_scaler, optimizer_step
    from faccel._prepare import prepare
    from faccel._process_group import is_main_process, main_process_first, shutdown, wait_for_everyone
    from faccel._progress import progress
    from faccel._pytree import register_pytree, static_field, tree_map
    from faccel._random import set_seed
    from faccel._save_model import load_model, save_model
    from faccel._sharding import Sharding
    from faccel._split import split_between_processes
    from faccel._state import DistState, detect, state_from_env
    from faccel._train_state import TrainState

# module -> the public names it defines; __getattr__ below imports them on first use.
_EXPORTS: dict[str, tuple[str, ...]] = {
    "faccel._accumulate": ("MicroStep", "accumulate", "micro_batches", "micro_step"),
    "faccel._backward": ("backward",),
    "faccel._checkpoint": ("checkpoint", "latest_checkpoint", "restore"),
    "faccel._clip": ("clip_grad_norm", "clip_grad_value"),
    "faccel._collectives": ("broadcast", "gather", "gather_object", "pad_across_processes", "reduce"),
    "faccel._data": ("PreparedLoader", "to_device"),
    "faccel._functional": ("FunctionalState", "loss_and_grad", "model_params"),
    "faccel._grad_sync": ("GradBuckets", "grad_buckets", "sync_grads"),
    "faccel._launch": ("LaunchInfo", "parse_launch"),
    "faccel._logging": ("RankLogger", "get_logger"),
    "faccel._metrics": ("gather_for_metrics",),
    "faccel._model": ("unwrap_model",),
    "faccel._optim": ("AdamWState", "SGDState", "adamw", "sgd"),
    "faccel._precision": ("autocast", "grad_scaler", "optimizer_step"),
    "faccel._prepare": ("prepare",),
    "faccel._process_group": ("is_main_process", "main_process_first", "shutdown", "wait_for_everyone"),
    "faccel._progress": ("progress",),
    "faccel._pytree": ("register_pytree", "static_field", "tree_map"),
    "faccel._random": ("set_seed",),
    "faccel._save_model": ("load_model", "save_model"),
    "faccel._sharding": ("Sharding",),
    "faccel._split": ("split_between_processes",),
    "faccel._state": ("DistState", "detect", "state_from_env"),
    "faccel._train_state": ("TrainState",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__version__ = "0.1.0"

__all__ = [
    "AdamWState",
    "DistState",
    "FunctionalState",
    "GradBuckets",
    "LaunchInfo",
    "MicroStep",
    "PreparedLoader",
    "RankLogger",
    "SGDState",
    "Sharding",
    "TrainState",
    "accumulate",
    "adamw",
    "autocast",
    "backward",
    "broadcast",
    "checkpoint",
    "clip_grad_norm",
    "clip_grad_value",
    "detect",
    "errors",
    "gather",
    "gather_for_metrics",
    "gather_object",
    "get_logger",
    "grad_buckets",
    "grad_scaler",
    "is_main_process",
    "latest_checkpoint",
    "load_model",
    "loss_and_grad",
    "main_process_first",
    "micro_batches",
    "micro_step",
    "model_params",
    "optimizer_step",
    "pad_across_processes",
    "parse_launch",
    "prepare",
    "progress",
    "reduce",
    "register_pytree",
    "restore",
    "save_model",
    "set_seed",
    "sgd",
    "shutdown",
    "split_between_processes",
    "state_from_env",
    "static_field",
    "sync_grads",
    "to_device",
    "tree_map",
    "unwrap_model",
    "wait_for_everyone",
]


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module("faccel.errors")
    module = _MODULE_OF.get(name)
    if module is None:
        msg = f"module 'faccel' has no attribute {name!r}"
        raise AttributeError(msg)
    value = getattr(importlib.import_module(module), name)
    # Bound here like an ordinary import, so the next access (faccel.backward in the
    # training loop) is a plain attribute lookup that never reaches this function.
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
