"""faccel: a plain PyTorch loop on any device, process count and precision, checkpointed exactly.

Pure functions over frozen records: :func:`detect` gives a :class:`DistState`,
:func:`prepare` readies models, optimizers and loaders for it, and
:func:`backward` runs the right backward pass.

Functional training (``torch.func``: pure loss-and-grad, gradient averaging,
pure optimizers, pytrees) lives in :mod:`faccel.func`.

Every public name is imported on first use (PEP 562): ``import faccel`` costs
next to nothing beside ``import torch``, and a script pays only for the parts
it uses. ``__all__`` is the public surface; it, the lazy imports and
``faccel.func``'s are all derived from the one table ``_PUBLIC`` below.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # _PUBLIC["faccel"] again, for type checkers and IDEs (tests/test_api.py compares)
    from faccel import errors as errors
    from faccel import func as func
    from faccel._accumulate import MicroStep as MicroStep
    from faccel._accumulate import accumulate as accumulate
    from faccel._accumulate import micro_batches as micro_batches
    from faccel._accumulate import micro_step as micro_step
    from faccel._accumulate import steps_per_epoch as steps_per_epoch
    from faccel._backward import backward as backward
    from faccel._checkpoint import checkpoint as checkpoint
    from faccel._checkpoint import latest_checkpoint as latest_checkpoint
    from faccel._checkpoint import restore as restore
    from faccel._clip import clip_grad_norm as clip_grad_norm
    from faccel._clip import clip_grad_value as clip_grad_value
    from faccel._collectives import any_rank as any_rank
    from faccel._collectives import broadcast as broadcast
    from faccel._collectives import gather as gather
    from faccel._collectives import gather_object as gather_object
    from faccel._collectives import pad_across_processes as pad_across_processes
    from faccel._collectives import reduce as reduce
    from faccel._data import PreparedLoader as PreparedLoader
    from faccel._data import to_device as to_device
    from faccel._launch import LaunchInfo as LaunchInfo
    from faccel._launch import parse_launch as parse_launch
    from faccel._layout import Layout as Layout
    from faccel._logging import RankLogger as RankLogger
    from faccel._logging import get_logger as get_logger
    from faccel._logging import print as print
    from faccel._mesh import device_mesh as device_mesh
    from faccel._metrics import gather_for_metrics as gather_for_metrics
    from faccel._model import unwrap_model as unwrap_model
    from faccel._notebook import launch as launch
    from faccel._precision import autocast as autocast
    from faccel._precision import grad_scaler as grad_scaler
    from faccel._precision import optimizer_step as optimizer_step
    from faccel._prepare import prepare as prepare
    from faccel._process_group import detect as detect
    from faccel._process_group import main_process_first as main_process_first
    from faccel._process_group import shutdown as shutdown
    from faccel._process_group import wait_for_everyone as wait_for_everyone
    from faccel._progress import progress as progress
    from faccel._random import set_seed as set_seed
    from faccel._save_model import load_model as load_model
    from faccel._save_model import save_model as save_model
    from faccel._sharding import Sharding as Sharding
    from faccel._signals import StopSignal as StopSignal
    from faccel._signals import stop_signal as stop_signal
    from faccel._split import split_between_processes as split_between_processes
    from faccel._state import DistState as DistState
    from faccel._state import state_from_env as state_from_env
    from faccel._tracking import Tracker as Tracker
    from faccel._tracking import end_training as end_training
    from faccel._tracking import init_tracker as init_tracker
    from faccel._tracking import log as log
    from faccel._train_state import TrainState as TrainState
    from faccel._uneven import uneven_inputs as uneven_inputs

# The public surface, the one table of it: namespace -> defining module -> names. A
# namespace's entry under its own name lists its public submodules. Each namespace's
# __all__, __getattr__ (imports on first use) and __dir__ come from here.
_PUBLIC: dict[str, dict[str, tuple[str, ...]]] = {
    "faccel": {
        "faccel": ("errors", "func"),
        "faccel._accumulate": ("MicroStep", "accumulate", "micro_batches", "micro_step", "steps_per_epoch"),
        "faccel._backward": ("backward",),
        "faccel._checkpoint": ("checkpoint", "latest_checkpoint", "restore"),
        "faccel._clip": ("clip_grad_norm", "clip_grad_value"),
        "faccel._collectives": (
            "any_rank",
            "broadcast",
            "gather",
            "gather_object",
            "pad_across_processes",
            "reduce",
        ),
        "faccel._data": ("PreparedLoader", "to_device"),
        "faccel._launch": ("LaunchInfo", "parse_launch"),
        "faccel._layout": ("Layout",),
        "faccel._logging": ("RankLogger", "get_logger", "print"),
        "faccel._mesh": ("device_mesh",),
        "faccel._metrics": ("gather_for_metrics",),
        "faccel._model": ("unwrap_model",),
        "faccel._notebook": ("launch",),
        "faccel._precision": ("autocast", "grad_scaler", "optimizer_step"),
        "faccel._prepare": ("prepare",),
        "faccel._process_group": ("detect", "main_process_first", "shutdown", "wait_for_everyone"),
        "faccel._progress": ("progress",),
        "faccel._random": ("set_seed",),
        "faccel._save_model": ("load_model", "save_model"),
        "faccel._sharding": ("Sharding",),
        "faccel._signals": ("StopSignal", "stop_signal"),
        "faccel._split": ("split_between_processes",),
        "faccel._state": ("DistState", "state_from_env"),
        "faccel._train_state": ("TrainState",),
        "faccel._tracking": ("Tracker", "end_training", "init_tracker", "log"),
        "faccel._uneven": ("uneven_inputs",),
    },
    "faccel.func": {
        "faccel._functional": ("FunctionalState", "loss_and_grad", "model_params"),
        "faccel._grad_sync": ("GradBuckets", "grad_buckets", "sync_grads"),
        "faccel._optim._base": ("Optimizer",),
        "faccel._optim._sgd": ("SGDState", "sgd"),
        "faccel._optim._adamw": ("AdamWState", "adamw"),
        "faccel._optim._groups": ("ParamGroupsState", "param_groups"),
        "faccel._tree": ("register_pytree", "static_field", "tree_map"),
    },
}


def _namespace(
    namespace: str, space: dict[str, Any]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` (PEP 562) and ``__dir__`` of ``namespace``, from :data:`_PUBLIC`.

    ``space`` is the namespace's globals, where each name is bound on first use.
    """
    public = sorted(name for names in _PUBLIC[namespace].values() for name in names)
    module_of = {name: module for module, names in _PUBLIC[namespace].items() for name in names}

    def resolve(name: str) -> Any:
        module = module_of.get(name)
        if module is None:
            msg = f"module {namespace!r} has no attribute {name!r}"
            raise AttributeError(msg)
        if module == namespace:  # a public submodule
            value = importlib.import_module(f"{namespace}.{name}")
        else:
            value = getattr(importlib.import_module(module), name)
        # Bound like an ordinary import, so the next access (faccel.backward in the
        # training loop) is a plain attribute lookup that never reaches this function.
        space[name] = value
        return value

    return public, resolve, lambda: list(public)


__version__ = "0.1.0"

__all__, __getattr__, __dir__ = _namespace(__name__, globals())
