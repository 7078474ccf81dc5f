"""faccel: a plain PyTorch loop on any device, process count and precision, checkpointed exactly.

Pure functions over frozen records: :func:`detect` gives a :class:`DistState`,
:func:`prepare` readies models, optimizers and loaders for it, and
:func:`backward` runs the right backward pass.
"""

from faccel import errors
from faccel._accumulate import MicroStep, accumulate, micro_batches, micro_step
from faccel._backward import backward
from faccel._checkpoint import checkpoint, latest_checkpoint, restore
from faccel._clip import clip_grad_norm, clip_grad_value
from faccel._collectives import broadcast, gather, gather_object, pad_across_processes, reduce
from faccel._data import PreparedLoader, to_device
from faccel._functional import FunctionalState, loss_and_grad, model_params
from faccel._grad_sync import sync_grads
from faccel._launch import LaunchInfo, parse_launch
from faccel._logging import RankLogger, get_logger
from faccel._metrics import gather_for_metrics
from faccel._model import unwrap_model
from faccel._optim import AdamWState, SGDState, adamw, sgd
from faccel._precision import autocast, grad_scaler, optimizer_step
from faccel._prepare import prepare
from faccel._process_group import (
    is_main_process,
    main_process_first,
    shutdown,
    wait_for_everyone,
)
from faccel._progress import progress
from faccel._pytree import register_pytree, static_field, tree_map
from faccel._random import set_seed
from faccel._save_model import load_model, save_model
from faccel._sharding import Sharding
from faccel._split import split_between_processes
from faccel._state import DistState, detect, state_from_env
from faccel._train_state import TrainState

__version__ = "0.1.0"

__all__ = [
    "AdamWState",
    "DistState",
    "FunctionalState",
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
