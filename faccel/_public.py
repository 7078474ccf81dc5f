"""The public surface of faccel, the one table of it, and the namespaces made from it.

:data:`PUBLIC` maps a namespace (``faccel``, ``faccel.func``) to its defining private
modules and the names each contributes. ``faccel/__init__.py`` and ``faccel/func/__init__.py``
build their ``__all__``, ``__getattr__`` (PEP 562 lazy imports) and ``__dir__`` from it
with :func:`namespace`; this module imports nothing of faccel's, so no package imports
back up into ``faccel/__init__.py``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

# The public surface, the one table of it: namespace -> defining module -> names. A
# namespace's entry under its own name lists its public submodules. Each namespace's
# __all__, __getattr__ (imports on first use) and __dir__ come from here.
_TABLE: dict[str, dict[str, tuple[str, ...]]] = {
    "faccel": {
        "faccel": ("errors", "func"),
        "faccel._loop._accumulate": ("accumulate", "micro_batches", "steps_per_epoch"),
        "faccel._loop._micro_step": ("MicroStep", "micro_step"),
        "faccel._loop._backward": ("backward",),
        "faccel._checkpoint": ("checkpoint", "free_memory", "latest_checkpoint", "restore"),
        "faccel._loop._clip": ("clip_grad_norm", "clip_grad_value"),
        "faccel._dist._collectives": (
            "any_rank",
            "broadcast",
            "gather",
            "gather_object",
            "pad_across_processes",
            "reduce",
        ),
        "faccel._data._loader": ("PreparedLoader", "to_device"),
        "faccel._dist._launch": ("LaunchInfo", "parse_launch"),
        "faccel._dist._layout": ("Layout",),
        "faccel._report._logging": ("RankLogger", "get_logger", "print"),
        "faccel._dist._mesh": ("device_mesh",),
        "faccel._loop._strategies._experts._balance": (
            "expert_load",
            "load_balancing_loss",
            "update_expert_bias",
        ),
        "faccel._data._metrics": ("gather_for_metrics",),
        "faccel._loop._strategies": ("unwrap_model",),
        "faccel._dist._notebook": ("launch",),
        "faccel._loop._precision": ("autocast", "grad_scaler", "optimizer_step"),
        "faccel._loop._prepare": ("prepare",),
        "faccel._dist._process_group": (
            "detect",
            "local_main_process_first",
            "main_process_first",
            "shutdown",
            "wait_for_everyone",
        ),
        "faccel._loop._schedule": ("accelerate_scheduler_steps",),
        "faccel._loop._batch_size": ("find_executable_batch_size",),
        "faccel._loop._strategies._ddp._local_sgd": ("LocalSGD", "local_sgd"),
        "faccel._loop._strategies._deepspeed._config": ("ConfigOptimizer", "ConfigScheduler"),
        "faccel._report._profile": ("profile",),
        "faccel._report._memory_plan": ("MemoryPlan", "estimate_memory"),
        "faccel._report._progress": ("progress",),
        "faccel._report._meter": ("Meter", "measure", "start_meter"),
        "faccel._report._flops": ("count_flops", "transformer_flops"),
        "faccel._report._stragglers": ("Spread", "Straggler", "check_stragglers"),
        "faccel._dist._random": ("set_seed",),
        "faccel._hf._load_model": ("load_model",),
        "faccel._hf._save_model": ("save_model",),
        "faccel._data._sharding": ("Sharding",),
        "faccel._data._split": ("split_between_processes",),
        "faccel._dist._signals": ("StopSignal", "stop_signal"),
        "faccel._dist._state": ("DistState", "state_from_env"),
        "faccel._train_state": ("TrainState",),
        "faccel._report._tracking": ("Tracker", "end_training", "init_tracker", "log"),
        "faccel._loop._uneven": ("uneven_inputs",),
        "faccel._data._context": ("context_positions", "context_shard", "context_unshard"),
        "faccel._loop._context": ("context_attention",),
        "faccel._loop._strategies._pipeline._stages": ("PipelinedModel", "Schedule"),
        "faccel._loop._forward_backward": ("forward_backward",),
        "faccel._ft._replicas": (
            "FaultTolerance",
            "ReplicaQuorum",
            "fault_tolerant",
            "replica_commit",
            "replica_quorum",
        ),
    },
    "faccel.func": {
        "faccel._func._functional": ("FunctionalState", "loss_and_grad", "model_params"),
        "faccel._func._grad_sync": ("GradBuckets", "grad_buckets", "sync_grads"),
        "faccel._func._optim._base": ("Optimizer",),
        "faccel._func._optim._sgd": ("SGDState", "sgd"),
        "faccel._func._optim._adamw": ("AdamWState", "adamw"),
        "faccel._func._optim._groups": ("ParamGroupsState", "param_groups"),
        "faccel._tree": ("register_pytree", "static_field", "tree_map"),
    },
}


# Read-only: the table is a constant of the package, never state.
PUBLIC = MappingProxyType({space: MappingProxyType(modules) for space, modules in _TABLE.items()})


def namespace(
    namespace: str, space: dict[str, Any]
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` (PEP 562) and ``__dir__`` of ``namespace``, from :data:`PUBLIC`.

    ``space`` is the namespace's globals, where each name is bound on first use.
    """
    public = sorted(name for names in PUBLIC[namespace].values() for name in names)
    module_of = {name: module for module, names in PUBLIC[namespace].items() for name in names}

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
