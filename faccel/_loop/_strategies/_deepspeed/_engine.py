"""DeepSpeed ZeRO (stages 0-3): the engine, the optimizer and scheduler over it, the seed loop's seams.

``deepspeed`` is imported only inside the functions that need it (here and in
``faccel._checkpoint._strategies._zero_state``): importing faccel never imports it. The engine is
built from the config ``_config`` fills (:func:`fill_config`).

The seed loop runs unchanged: ``prepare`` returns the engine as the model and
a :class:`DeepSpeedOptimizer` whose ``step`` is the engine's; ``backward``
finds the engine from the loss's graph and runs the engine's backward with
faccel's micro-step as the accumulation boundary.

Checkpoints, ``save_model`` and ``load_model`` see ZeRO's state as whole
tensors, gathered and scattered by ``faccel._checkpoint._strategies._zero_state``. DeepSpeed's own
``save_checkpoint`` (pickle) is never used.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from faccel._dist._launch import deepspeed_environment
from faccel._dist._process_group import last_calls
from faccel._dist._state import DistState
from faccel._loop._strategies._deepspeed._config import (
    ConfigOptimizer,
    ConfigScheduler,
    fill_config,
    hidden_size_of,
)
from faccel._marks import DEEPSPEED_ENGINE
from faccel.errors import FaccelError, PrepareError, RankFailedError, UsageError

__all__ = [
    "DeepSpeedOptimizer",
    "DeepSpeedScheduler",
    "engine_backward",
    "is_deepspeed_engine",
    "prepare_deepspeed",
    "whole_shape",
]


# Set on each Parameter of an engine's module: the engine (weakly), for backward() to find
# from the loss's graph. (A mark on user objects, as _prepare's _REPLACED_BY.)
_ENGINE = DEEPSPEED_ENGINE


def whole_shape(param: torch.Tensor) -> tuple[int, ...]:
    """A parameter's whole shape: ZeRO-3 keeps it as ``ds_shape`` beside the partition."""
    shape = getattr(param, "ds_shape", None)  # ZeRO-3: the partitioned parameter's whole shape
    return tuple(shape) if shape is not None else tuple(param.shape)


def _whole_meta(param: torch.Tensor) -> torch.Tensor:
    return torch.empty(whole_shape(param), dtype=torch.float32, device="meta")


def is_deepspeed_engine(model: object) -> bool:
    """Whether ``model`` is a DeepSpeed engine (looked up, never importing deepspeed).

    Example:
        >>> is_deepspeed_engine(torch.nn.Linear(1, 1))
        False
    """
    engine = sys.modules.get("deepspeed.runtime.engine")
    return engine is not None and isinstance(model, engine.DeepSpeedEngine)


class DeepSpeedOptimizer(torch.optim.Optimizer):
    """The optimizer ``prepare`` returns under ``strategy='deepspeed'``: the seed loop's seam to the engine.

    ``step()`` is the engine's step (ZeRO's partitioned update, clipping if the
    config asks, loss-scale bookkeeping under fp16); ``zero_grad()`` clears
    ZeRO's gradient partitions. ``param_groups`` and ``state`` are those of the
    torch optimizer you built, so an LR scheduler made on it (before or after
    ``prepare``) steps the learning rate DeepSpeed uses. The engine is
    :attr:`engine`; the torch optimizer :attr:`optimizer`.
    """

    # The names state.json recorded for this class before it moved here; restore accepts them.
    formerly = ("faccel._loop._deepspeed.DeepSpeedOptimizer",)

    def __init__(
        self,
        engine: nn.Module,
        optimizer: torch.optim.Optimizer,
        groups: Sequence[Sequence[nn.Parameter]] | None = None,
        dist: DistState | None = None,
    ) -> None:
        # Not Optimizer.__init__: the parameters (ZeRO's partitions) belong to the engine.
        self.engine = engine
        self.dist = dist  # whose rank a lost peer's error names
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        # The model's parameters in each group, as the torch optimizer held them before ZeRO
        # replaced them by flat partitions: the order a checkpoint numbers them in.
        self.groups = [list(group) for group in groups] if groups is not None else []

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The torch optimizer's groups (their ``lr`` is the one DeepSpeed steps with)."""
        return self.optimizer.param_groups

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        """The torch optimizer's state (under ZeRO: of this rank's partitions)."""
        return self.optimizer.state

    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """The engine's optimizer step (``engine.step()``); ``closure`` is refused (DeepSpeed has none)."""
        if closure is not None:
            msg = "a DeepSpeed step takes no closure; run the forward and faccel.backward before step()"
            raise UsageError(msg)
        with _peers_stay(self.dist, "the DeepSpeed optimizer step"):
            self.engine.step()  # type: ignore[operator]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients (ZeRO's partitions and the module's ``.grad``)."""
        self.engine.optimizer.zero_grad(set_to_none=set_to_none)  # type: ignore[union-attr]
        self.engine.zero_grad()  # type: ignore[operator]

    def checkpoint_groups(self) -> list[dict[str, Any]]:
        """The groups as a checkpoint numbers them: the torch groups' hyperparameters, and for
        ``params`` a ``meta`` stand-in of each model parameter's whole shape in float32 (the
        dtype ZeRO keeps optimizer state in)."""
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [_whole_meta(p) for p in params]}
            for group, params in zip(self.param_groups, self.groups, strict=True)
        ]

    def state_dict(self) -> dict[str, Any]:
        """Refused: ZeRO's state is gathered by every rank together, which ``faccel.checkpoint`` does."""
        msg = (
            "a DeepSpeed run's optimizer state lies in ZeRO's per-rank partitions, which every rank "
            "gathers together: save it with faccel.checkpoint(dist, state, root) on every rank (and "
            "load it with faccel.restore), not with optimizer.state_dict() (docs/deepspeed.md)"
        )
        raise UsageError(msg)

    def load_state_dict(self, state_dict: Any) -> None:
        """Refused, as :meth:`state_dict`: ``faccel.restore`` loads a DeepSpeed run."""
        self.state_dict()

    def __repr__(self) -> str:
        return f"DeepSpeedOptimizer({self.optimizer!r})"


class DeepSpeedScheduler(torch.optim.lr_scheduler.LRScheduler):
    """The scheduler ``prepare`` returns for a :class:`ConfigScheduler`: DeepSpeed's schedule from the config.

    DeepSpeed steps it inside ``optimizer.step()`` (the engine's step, once per
    optimizer step, not on a skipped fp16 step), so :meth:`step` does nothing:
    a loop that calls ``scheduler.step()`` or
    ``faccel.optimizer_step(dist, optimizer, scheduler=scheduler)`` runs the
    schedule once per optimizer step, as Accelerate's wrapper of it does.
    ``state_dict`` is the schedule's own (with its type), so checkpoints hold it
    and ``restore`` puts it back. DeepSpeed's object is :attr:`scheduler`.
    """

    # The names state.json recorded for this class before it moved here; restore accepts them.
    formerly = ("faccel._loop._deepspeed.DeepSpeedScheduler",)

    def __init__(self, scheduler: Any, optimizer: torch.optim.Optimizer) -> None:
        # Not LRScheduler.__init__: DeepSpeed's schedule sets the learning rates itself.
        self.scheduler = scheduler
        self.optimizer = optimizer

    @property  # type: ignore[override]
    def last_epoch(self) -> int:  # type: ignore[override]
        """The schedule's last step (DeepSpeed's ``last_batch_iteration``)."""
        return int(self.scheduler.last_batch_iteration)

    def step(self, epoch: int | None = None) -> None:
        """Nothing: the engine's step already stepped the schedule (see the class)."""

    def get_last_lr(self) -> list[float | torch.Tensor]:
        """The learning rates the schedule last set, one per group (the groups' ``lr``: right after a
        restore too, where DeepSpeed's own ``get_last_lr`` is stale until the next step)."""
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        """The schedule's state and its type (``WarmupLR``, ``WarmupDecayLR``...)."""
        return {"type": type(self.scheduler).__name__, **self.scheduler.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """The saved state, refused when it is another type of schedule's."""
        saved = dict(state_dict)
        kind = saved.pop("type", None)
        if kind != type(self.scheduler).__name__:
            msg = f"a {kind} schedule's state cannot load into DeepSpeed's {type(self.scheduler).__name__}"
            raise ValueError(msg)
        self.scheduler.load_state_dict(saved)

    def __deepcopy__(self, memo: dict[int, Any]) -> DeepSpeedScheduler:
        # A restore's trial load runs on a copy: the schedule alone, never the engine behind it.
        return DeepSpeedScheduler(copy.copy(self.scheduler), self.optimizer)

    def __repr__(self) -> str:
        return f"DeepSpeedScheduler({type(self.scheduler).__name__})"


def _engine_of(loss: torch.Tensor) -> Any:
    """The engine whose parameters ``loss`` was computed from: the first one its graph reaches."""
    stack = [loss.grad_fn]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf (a parameter)
        if variable is not None:
            ref = getattr(variable, _ENGINE, None)
            engine = ref() if ref is not None else None
            if engine is not None:
                return engine
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    msg = (
        "under strategy='deepspeed' faccel.backward needs a loss computed by the model faccel.prepare "
        "returned (the DeepSpeed engine), but this loss's graph reaches none of its parameters; "
        "compute the loss from the prepared model's output"
    )
    raise UsageError(msg)


def engine_backward(loss: torch.Tensor, *, sync: bool, dist: DistState | None = None, **kwargs: Any) -> None:
    """The engine's backward for ``loss`` (already divided by the micro-step's group size).

    ``sync`` (faccel's micro-step) is the accumulation boundary: ZeRO reduces
    the gradients for the step at the micro-step that syncs. DeepSpeed's own
    division by its accumulation steps is off (faccel divides by the group's
    real size, the last partial group of an epoch included), and fp16 loss
    scaling is DeepSpeed's.
    """
    engine = _engine_of(loss)
    engine.set_gradient_accumulation_boundary(sync)
    with _peers_stay(dist, "the DeepSpeed backward"):
        engine.backward(loss, scale_wrt_gas=False, retain_graph=bool(kwargs.pop("retain_graph", False)))
    if kwargs:
        msg = f"under strategy='deepspeed' backward takes only retain_graph, got {sorted(kwargs)}"
        raise UsageError(msg)


@contextlib.contextmanager
def _peers_stay(dist: DistState | None, what: str) -> Iterator[None]:
    """The backend's report of a peer lost inside DeepSpeed's own collectives, as a :class:`RankFailedError`.

    DeepSpeed runs the collectives of its backward and step itself, so faccel's
    collective wrapper never sees them: a peer killed there left the survivor
    gloo's bare ``RuntimeError``. A faccel error, or an error that is not the
    backend's, passes unchanged.
    """
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, FaccelError) or not _from_backend(error):
            raise
        raise RankFailedError(_left_message(dist, what, error)) from error


def _from_backend(error: RuntimeError) -> bool:
    import torch.distributed as tdist

    text = str(error)
    return isinstance(error, tdist.DistError) or any(word in text for word in _BACKEND_WORDS)


# What gloo's and NCCL's reports of a lost peer or a collective past its timeout say.
_BACKEND_WORDS = ("gloo", "Gloo", "NCCL", "Connection closed", "Connection reset", "Timed out", "timed out")


def _left_message(dist: DistState | None, what: str, error: RuntimeError) -> str:
    import torch.distributed as tdist

    rank = dist.rank if dist is not None else tdist.get_rank()
    world = dist.world_size if dist is not None else tdist.get_world_size()
    others = [r for r in range(world) if r != rank]
    who = f"rank {others[0]}, its only peer," if len(others) == 1 else f"one of ranks {others}"
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    calls = last_calls(dist, others) if dist is not None else ""
    timeout = f" ({dist.timeout})" if dist is not None else ""
    return (
        f"{what} on rank {rank} of {world}: {who} left the job or stopped answering during it "
        f"(the backend said: {first}){calls}. That rank's log holds its first error (a crash, an out-"
        f"of-memory kill, a signal), or it hung past the timeout{timeout}; restart the job from the "
        "latest checkpoint (faccel.restore)"
    )


def _build(
    dist: DistState,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    config: dict[str, Any],
    groups: list[dict[str, Any]] | None = None,
) -> Any:
    try:
        import deepspeed
    except ImportError:
        msg = (
            "strategy='deepspeed' needs DeepSpeed, which is not installed; "
            "pip install 'faccel[deepspeed]' (or choose strategy='fsdp')"
        )
        raise PrepareError(msg) from None
    _use_accelerator(dist)
    _one_process_group(dist)
    model.to(dist.device)
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=optimizer,  # None: DeepSpeed builds the config's optimizer over ``groups``
        model_parameters=groups,
        config=config,
        dist_init_required=False,  # faccel's group, or the one-rank group above
    )
    ref = weakref.ref(engine)
    for param in engine.module.parameters():
        setattr(param, _ENGINE, ref)
    return engine


def _use_accelerator(dist: DistState) -> None:
    """DeepSpeed's accelerator for ``dist.device``, set through DeepSpeed's API, not the environment.

    DeepSpeed picks one at import (CUDA when it sees a GPU, else the CPU with a
    log line); a CPU run on a machine with a GPU needs its CPU accelerator.
    """
    from deepspeed.accelerator import get_accelerator, set_accelerator

    wanted = "cuda" if dist.device.type == "cuda" else "cpu"
    if get_accelerator().device_name() == wanted:
        return
    if wanted == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        set_accelerator(CUDA_Accelerator())


def _one_process_group(dist: DistState) -> None:
    """A one-rank process group for DeepSpeed in a plain one-process run (no launcher variables).

    DeepSpeed needs a process group and, finding no ``RANK``/``MASTER_ADDR``,
    would look for MPI (``ModuleNotFoundError: mpi4py``). One rank on an
    in-process store needs no network; ``faccel.shutdown`` destroys it. The
    engine still reads ``LOCAL_RANK`` from the environment: written where unset,
    from the launcher table's list (``faccel._dist._launch.deepspeed_environment``).
    """
    for name, value in deepspeed_environment(dist.local_rank).items():
        os.environ.setdefault(name, value)
    if dist.world_size > 1 and not torch.distributed.is_initialized():
        msg = (
            f"strategy='deepspeed' on {dist.world_size} processes needs the process group faccel.detect() "
            "starts, and none is running (detect(start=False)?); call faccel.detect() under the launcher"
        )
        raise PrepareError(msg)
    if dist.world_size == 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            dist.backend, store=torch.distributed.HashStore(), rank=0, world_size=1
        )


def _fused_adam_groups(optimizer: torch.optim.Optimizer) -> None:
    """DeepSpeed's ``FusedAdam`` adds ``step: 0`` to each group at its first step (and never changes
    it): added at the build, so a fresh run's groups have the keys a checkpoint's have."""
    from deepspeed.ops.adam import FusedAdam

    if isinstance(optimizer, FusedAdam):
        for group in optimizer.param_groups:
            group.setdefault("step", 0)


def _param_groups(model: nn.Module, params: Any) -> list[dict[str, Any]]:
    """A :class:`ConfigOptimizer`'s parameters as torch param groups (every parameter: one group)."""
    items: list[Any] = list(model.parameters()) if params is None else list(params)
    if items and all(isinstance(item, dict) for item in items):
        return [{**group, "params": list(group["params"])} for group in items]
    return [{"params": items}]


def prepare_deepspeed(
    dist: DistState, objs: Sequence[Any], prepare_other: Callable[[Any], Any]
) -> tuple[Any, ...]:
    """``prepare`` under ``strategy='deepspeed'``: loaders first (their batch size), then the engine.

    Args:
        dist: The run's :class:`DistState` (``dist.deepspeed`` holds the config).
        objs: The objects given to ``prepare``, in order.
        prepare_other: How ``prepare`` handles everything but the model and
            optimizer (loaders, schedulers, tags).

    Returns:
        The prepared objects in the given order: the engine for the model, a
        :class:`DeepSpeedOptimizer` for the optimizer (a torch one, or a
        :class:`ConfigOptimizer`: DeepSpeed's from the config), a
        :class:`DeepSpeedScheduler` for a :class:`ConfigScheduler`.

    Raises:
        PrepareError: Not exactly one model with exactly one optimizer, or
            DeepSpeed is not installed.
        DeepSpeedConfigError: The config contradicts faccel (:func:`fill_config`).
    """
    models = [i for i, obj in enumerate(objs) if isinstance(obj, nn.Module)]
    optimizers = [i for i, obj in enumerate(objs) if isinstance(obj, torch.optim.Optimizer | ConfigOptimizer)]
    done = [
        i
        for i in models + optimizers
        if is_deepspeed_engine(objs[i]) or isinstance(objs[i], DeepSpeedOptimizer)
    ]
    if done and len(done) == len(models) + len(optimizers):
        prepared = {i: objs[i] for i in done}
    elif len(models) != 1 or len(optimizers) != 1:
        msg = (
            f"under strategy='deepspeed' prepare builds one DeepSpeed engine from one model and its "
            f"optimizer, got {len(models)} model(s) and {len(optimizers)} optimizer(s); pass the model, "
            "its torch optimizer (or faccel.ConfigOptimizer() for the config's) and the training loader "
            "in one faccel.prepare call"
        )
        raise PrepareError(msg)
    else:
        prepared = {}
    schedules = [i for i, obj in enumerate(objs) if isinstance(obj, ConfigScheduler)]
    torch_schedules = [
        i
        for i, obj in enumerate(objs)
        if isinstance(obj, torch.optim.lr_scheduler.LRScheduler) and not isinstance(obj, DeepSpeedScheduler)
    ]
    if prepared and schedules:
        msg = "a faccel.ConfigScheduler goes to the prepare call that builds the engine, with the model"
        raise PrepareError(msg)
    others = {i: prepare_other(obj) for i, obj in enumerate(objs) if i not in models + optimizers + schedules}
    if not prepared:
        sizes = [
            getattr(others[i], "batch_size", None) for i in sorted(others) if hasattr(others[i], "sharding")
        ]
        micro = next((size for size in sizes if isinstance(size, int)), None)
        model, optimizer = objs[models[0]], objs[optimizers[0]]
        schedule = next((objs[i] for i in schedules + torch_schedules), None)
        if len(schedules) > 1:
            msg = f"prepare got {len(schedules)} faccel.ConfigScheduler objects; the config has one schedule"
            raise PrepareError(msg)
        config = fill_config(
            dist.deepspeed or "{}",
            dist=dist,
            micro_batch_size=micro,
            hidden_size=hidden_size_of(model),
            optimizer=optimizer,
            scheduler=schedule,
        )
        if isinstance(optimizer, ConfigOptimizer):
            param_groups = _param_groups(model, optimizer.params)
            # Before the build: torch's optimizer keeps these dicts and ZeRO puts its flat partitions in them.
            groups = [list(group["params"]) for group in param_groups]
            engine = _build(dist, model, None, config, param_groups)
            torch_optimizer = engine.basic_optimizer
            _fused_adam_groups(torch_optimizer)
        else:
            groups = [list(group["params"]) for group in optimizer.param_groups]
            engine = _build(dist, model, optimizer, config)
            torch_optimizer = optimizer
        wrapped = DeepSpeedOptimizer(engine, torch_optimizer, groups, dist)
        prepared = {models[0]: engine, optimizers[0]: wrapped}
        for i in schedules:
            prepared[i] = DeepSpeedScheduler(engine.lr_scheduler, wrapped)
    return tuple(prepared[i] if i in prepared else others[i] for i in range(len(objs)))
