"""faccel: a plain PyTorch loop on any device, process count and precision, checkpointed exactly.

Pure functions over frozen records: :func:`detect` gives a :class:`DistState`,
:func:`prepare` readies models, optimizers and loaders for it, and
:func:`backward` runs the right backward pass.

Functional training (``torch.func``: pure loss-and-grad, gradient averaging,
pure optimizers, pytrees) lives in :mod:`faccel.func`.

Every public name is imported on first use (PEP 562): ``import faccel`` costs
next to nothing beside ``import torch``, and a script pays only for the parts
it uses. ``__all__`` is the public surface; it, the lazy imports and
``faccel.func``'s are all derived from the one table in ``faccel/_public.py``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if (
    TYPE_CHECKING
):  # PUBLIC["faccel"] of faccel/_public.py again, for type checkers and IDEs (tests/test_api.py compares)
    from faccel import errors as errors
    from faccel import func as func
    from faccel._checkpoint import checkpoint as checkpoint
    from faccel._checkpoint import free_memory as free_memory
    from faccel._checkpoint import latest_checkpoint as latest_checkpoint
    from faccel._checkpoint import restore as restore
    from faccel._data._context import context_positions as context_positions
    from faccel._data._context import context_shard as context_shard
    from faccel._data._context import context_unshard as context_unshard
    from faccel._data._loader import PreparedLoader as PreparedLoader
    from faccel._data._loader import to_device as to_device
    from faccel._data._metrics import gather_for_metrics as gather_for_metrics
    from faccel._data._sharding import Sharding as Sharding
    from faccel._data._split import split_between_processes as split_between_processes
    from faccel._dist._collectives import any_rank as any_rank
    from faccel._dist._collectives import broadcast as broadcast
    from faccel._dist._collectives import gather as gather
    from faccel._dist._collectives import gather_object as gather_object
    from faccel._dist._collectives import pad_across_processes as pad_across_processes
    from faccel._dist._collectives import reduce as reduce
    from faccel._dist._launch import LaunchInfo as LaunchInfo
    from faccel._dist._launch import parse_launch as parse_launch
    from faccel._dist._layout import Layout as Layout
    from faccel._dist._mesh import device_mesh as device_mesh
    from faccel._dist._notebook import launch as launch
    from faccel._dist._process_group import detect as detect
    from faccel._dist._process_group import local_main_process_first as local_main_process_first
    from faccel._dist._process_group import main_process_first as main_process_first
    from faccel._dist._process_group import shutdown as shutdown
    from faccel._dist._process_group import wait_for_everyone as wait_for_everyone
    from faccel._dist._random import set_seed as set_seed
    from faccel._dist._signals import StopSignal as StopSignal
    from faccel._dist._signals import stop_signal as stop_signal
    from faccel._dist._state import DistState as DistState
    from faccel._dist._state import state_from_env as state_from_env
    from faccel._ft._replicas import FaultTolerance as FaultTolerance
    from faccel._ft._replicas import ReplicaQuorum as ReplicaQuorum
    from faccel._ft._replicas import fault_tolerant as fault_tolerant
    from faccel._ft._replicas import replica_commit as replica_commit
    from faccel._ft._replicas import replica_quorum as replica_quorum
    from faccel._hf._load_model import load_model as load_model
    from faccel._hf._save_model import save_model as save_model
    from faccel._loop._accumulate import accumulate as accumulate
    from faccel._loop._accumulate import micro_batches as micro_batches
    from faccel._loop._accumulate import steps_per_epoch as steps_per_epoch
    from faccel._loop._backward import backward as backward
    from faccel._loop._batch_size import find_executable_batch_size as find_executable_batch_size
    from faccel._loop._clip import clip_grad_norm as clip_grad_norm
    from faccel._loop._clip import clip_grad_value as clip_grad_value
    from faccel._loop._context import context_attention as context_attention
    from faccel._loop._forward_backward import forward_backward as forward_backward
    from faccel._loop._micro_step import MicroStep as MicroStep
    from faccel._loop._micro_step import micro_step as micro_step
    from faccel._loop._precision import autocast as autocast
    from faccel._loop._precision import grad_scaler as grad_scaler
    from faccel._loop._precision import optimizer_step as optimizer_step
    from faccel._loop._prepare import prepare as prepare
    from faccel._loop._schedule import accelerate_scheduler_steps as accelerate_scheduler_steps
    from faccel._loop._strategies import unwrap_model as unwrap_model
    from faccel._loop._strategies._ddp._local_sgd import LocalSGD as LocalSGD
    from faccel._loop._strategies._ddp._local_sgd import local_sgd as local_sgd
    from faccel._loop._strategies._deepspeed._config import ConfigOptimizer as ConfigOptimizer
    from faccel._loop._strategies._deepspeed._config import ConfigScheduler as ConfigScheduler
    from faccel._loop._strategies._experts._balance import expert_load as expert_load
    from faccel._loop._strategies._experts._balance import load_balancing_loss as load_balancing_loss
    from faccel._loop._strategies._experts._balance import update_expert_bias as update_expert_bias
    from faccel._loop._strategies._pipeline._stages import PipelinedModel as PipelinedModel
    from faccel._loop._strategies._pipeline._stages import Schedule as Schedule
    from faccel._loop._uneven import uneven_inputs as uneven_inputs
    from faccel._report._flops import count_flops as count_flops
    from faccel._report._flops import transformer_flops as transformer_flops
    from faccel._report._logging import RankLogger as RankLogger
    from faccel._report._logging import get_logger as get_logger
    from faccel._report._logging import print as print
    from faccel._report._memory_plan import MemoryPlan as MemoryPlan
    from faccel._report._memory_plan import estimate_memory as estimate_memory
    from faccel._report._meter import Meter as Meter
    from faccel._report._meter import measure as measure
    from faccel._report._meter import start_meter as start_meter
    from faccel._report._profile import profile as profile
    from faccel._report._progress import progress as progress
    from faccel._report._stragglers import Spread as Spread
    from faccel._report._stragglers import Straggler as Straggler
    from faccel._report._stragglers import check_stragglers as check_stragglers
    from faccel._report._tracking import Tracker as Tracker
    from faccel._report._tracking import end_training as end_training
    from faccel._report._tracking import init_tracker as init_tracker
    from faccel._report._tracking import log as log
    from faccel._train_state import TrainState as TrainState

from faccel._public import namespace as _namespace

__version__ = "0.1.0"

__all__, __getattr__, __dir__ = _namespace(__name__, globals())
