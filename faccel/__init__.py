"""faccel: a plain PyTorch loop on any device, process count and precision, checkpointed exactly.

Pure functions over frozen records: :func:`detect` gives a :class:`DistState`,
:func:`prepare` readies models, optimizers and loaders for it, and
:func:`backward` runs the right backward pass.
"""

from faccel import errors
from faccel._backward import backward
from faccel._data import PreparedLoader, to_device
from faccel._launch import LaunchInfo, parse_launch
from faccel._model import unwrap_model
from faccel._prepare import prepare
from faccel._process_group import (
    is_main_process,
    main_process_first,
    shutdown,
    wait_for_everyone,
)
from faccel._sharding import Sharding
from faccel._state import DistState, detect, state_from_env

__version__ = "0.1.0"

__all__ = [
    "DistState",
    "LaunchInfo",
    "PreparedLoader",
    "Sharding",
    "backward",
    "detect",
    "errors",
    "is_main_process",
    "main_process_first",
    "parse_launch",
    "prepare",
    "shutdown",
    "state_from_env",
    "to_device",
    "unwrap_model",
    "wait_for_everyone",
]
