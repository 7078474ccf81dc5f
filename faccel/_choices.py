"""The closed sets of faccel's options: each a ``Literal`` type, its values, and the one check of a value.

An option that takes one of a few words (a precision, a strategy, how loader
workers are seeded, where FSDP2 offloads, a tracker's back-end, how a meta
model is initialized) is annotated with its ``Literal`` type here, and a value
outside the set is refused in one place, :meth:`ClosedSet.check`, with an
:class:`~faccel.errors.ArgumentValueError` (or its subclass the set names:
``PrecisionError`` for a precision, ``LaunchError`` for a strategy). The
set-up functions' type check (``faccel._typecheck.setup_checked``) runs these
checks first, so a wrong word is a bad value, not a wrong type; the records
that hold the options (``DistState``, ``PrepareOptions``) check again when
they are made directly.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, get_args

import attrs

from faccel.errors import ArgumentValueError, LaunchError, PrecisionError

__all__ = [
    "BACKEND",
    "CLOSED_SETS",
    "COMM_HOOK",
    "ENGINE",
    "INIT",
    "OFFLOAD",
    "PRECISION",
    "REDUCE_OP",
    "STRATEGY",
    "TRACKER_KIND",
    "WORKER_SEEDS",
    "Backend",
    "ClosedSet",
    "CommHookName",
    "Engine",
    "Init",
    "Launcher",
    "Offload",
    "Precision",
    "ReduceOpName",
    "Strategy",
    "TrackerKind",
    "WorkerSeeds",
]

#: ``DistState.precision``: full precision, or autocast to bfloat16 / float16.
Precision = Literal["no", "bf16", "fp16"]
#: ``DistState.strategy``: DDP replicates the model, FSDP2 shards it, DeepSpeed's ZeRO partitions it.
Strategy = Literal["ddp", "fsdp", "deepspeed"]
#: ``prepare(worker_seeds=...)``: per rank and batch, per batch, or the DataLoader's own.
WorkerSeeds = Literal["rank", "shared", "torch"]
#: ``prepare(offload=...)``: FSDP2's CPUOffloadPolicy (None: everything on the device).
Offload = Literal["cpu"]
#: ``prepare(init=...)`` for a meta-built model, besides a callable.
Init = Literal["reset", "empty"]
#: ``init_tracker(kind=...)``: one back-end, or every one installed.
TrackerKind = Literal["jsonl", "csv", "tensorboard", "wandb", "mlflow", "all"]
#: ``loss_and_grad(engine=...)``: torch.autograd, or torch.func's transforms.
Engine = Literal["autograd", "func"]
#: ``prepare(comm_hook=...)``: torch's DDP communication hooks.
CommHookName = Literal["fp16", "bf16", "powersgd", "batched_powersgd"]
#: ``reduce(op=...)``: how the ranks' tensors are combined elementwise.
ReduceOpName = Literal["sum", "mean", "max", "min"]
#: ``DistState.backend``: the torch.distributed backends faccel pairs with a device type.
Backend = Literal["gloo", "nccl", "mpi", "xccl", "ucc"]
#: ``DistState.launcher``: who started the process (a launcher of ``faccel._dist._launch``'s table,
#: none, or a simulated state).
Launcher = Literal["none", "torchrun", "slurm", "mpi", "simulated"]


@attrs.frozen
class ClosedSet:
    """One option's allowed words, and the error a word outside them raises.

    Example:
        >>> PRECISION.check("bf16")
        'bf16'
        >>> PRECISION.check("fp32")
        Traceback (most recent call last):
        ...
        faccel.errors.PrecisionError: precision must be one of ['bf16', 'fp16', 'no'], got 'fp32'
    """

    name: str
    values: tuple[Any, ...]
    error: type[ArgumentValueError] = ArgumentValueError
    # How the message spells the allowed values (after "{name} must be ").
    spelled: str = ""
    # What the caller can do, after the value received.
    hint: str = ""

    def check(self, value: Any) -> Any:
        """``value`` if it is one of :attr:`values`; else raise :attr:`error` naming the option."""
        if isinstance(value, str | type(None)) and value in self.values:
            return value
        spelled = self.spelled or f"one of {sorted(v for v in self.values if v is not None)}"
        msg = f"{self.name} must be {spelled}, got {value!r}{self.hint}"
        raise self.error(msg)


PRECISION = ClosedSet("precision", get_args(Precision), PrecisionError)
STRATEGY = ClosedSet("strategy", get_args(Strategy), LaunchError)
WORKER_SEEDS = ClosedSet("worker_seeds", get_args(WorkerSeeds), spelled=f"one of {get_args(WorkerSeeds)}")
OFFLOAD = ClosedSet(
    "offload",
    (None, *get_args(Offload)),
    spelled="None (the sharded parameters stay on dist.device) or 'cpu' (FSDP2's CPUOffloadPolicy: "
    "parameters, gradients and the optimizer step on the CPU)",
)
INIT = ClosedSet("init", get_args(Init), spelled="'reset', 'empty' or a callable init(module)")
ENGINE = ClosedSet("engine", get_args(Engine), spelled=f"one of {get_args(Engine)}")
COMM_HOOK = ClosedSet(
    "comm_hook", (None, *get_args(CommHookName)), spelled=f"one of {get_args(CommHookName)} or None"
)
REDUCE_OP = ClosedSet("op", get_args(ReduceOpName))
BACKEND = ClosedSet(
    "backend", (None, *get_args(Backend)), LaunchError, spelled=f"one of {get_args(Backend)} or None"
)
TRACKER_KIND = ClosedSet(
    "kind", get_args(TrackerKind), spelled=f"one of {[*sorted(get_args(TrackerKind)[:-1]), 'all']}"
)

#: Each closed set by the name of its ``Literal`` type, as annotations spell it (the type check's table).
CLOSED_SETS: Mapping[str, ClosedSet] = MappingProxyType(
    {
        "Precision": PRECISION,
        "Strategy": STRATEGY,
        "WorkerSeeds": WORKER_SEEDS,
        "Offload": OFFLOAD,
        "Init": INIT,
        "TrackerKind": TRACKER_KIND,
        "Engine": ENGINE,
        "CommHookName": COMM_HOOK,
        "ReduceOpName": REDUCE_OP,
        "Backend": BACKEND,
    }
)
