"""faccel: a plain PyTorch loop on any device, process count and precision, checkpointed exactly.

Pure functions over frozen records: :func:`detect` gives a :class:`DistState`,
:func:`prepare` readies models, optimizers and loaders for it, and
:func:`backward` runs the right backward pass.
"""

from faccel import errors
from faccel._accumulate import MicroStep, accumulate, micro_batches, micro_step
from faccel._backward import backward
from faccel._clip import clip_grad_norm, clip_grad_value
from faccel._data import PreparedLoader, to_device
from faccel._launch import LaunchInfo, parse_launch
from faccel._logging import RankLogger, get_logger
from faccel._model import unwrap_model
from faccel._precision import autocast, grad_scaler, optimizer_step
from faccel._prepare import prepare
from faccel._process_group import (
    is_main_process,
    main_process_first,
    shutdown,
    wait_for_everyone,
)
from faccel._progress import progress
from faccel._sharding import Sharding
from faccel._state import DistState, detect, state_from_env

__version__ = "0.1.0"

__all__ = [
    "DistState",
    "LaunchInfo",
    "MicroStep",
    "PreparedLoader",
    "RankLogger",
    "Sharding",
    "accumulate",
    "autocast",
    "backward",
    "clip_grad_norm",
    "clip_grad_value",
    "detect",
    "errors",
    "get_logger",
    "grad_scaler",
    "is_main_process",
    "main_process_first",
    "micro_batches",
    "micro_step",
    "optimizer_step",
    "parse_launch",
    "prepare",
    "progress",
    "shutdown",
    "state_from_env",
    "to_device",
    "unwrap_model",
    "wait_for_everyone",
]
