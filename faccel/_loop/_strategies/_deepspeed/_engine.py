"""DeepSpeed ZeRO (stages 0-3) as a strategy: the config faccel fills, the engine, the seed loop's seams.

``deepspeed`` is imported only inside the functions that need it (here and in
``_zero_state``): importing faccel never imports it. The config is a value:
:func:`faccel._dist._deepspeed_config.read_config` turns a dict or a JSON file into canonical JSON text that
``DistState.deepspeed`` holds, and :func:`fill_config` (pure) completes it
with what faccel knows (docs/deepspeed.md):

* ``train_micro_batch_size_per_gpu``: the prepared loader's batch size;
* ``gradient_accumulation_steps``: ``dist.accumulation_steps``;
* ``train_batch_size``: their product times the data-parallel world size;
* ``fp16`` / ``bf16``: ``dist.precision``;
* ``gradient_clipping``: 0 when the config leaves it out (nothing is clipped
  that the user did not ask for); ``"auto"`` is 1.0, as Accelerate and the
  Hugging Face Trainer resolve it, so a config written for them trains the same;
* ``zero_optimization.reduce_bucket_size``, ``stage3_prefetch_bucket_size``,
  ``stage3_param_persistence_threshold`` at ``"auto"``: from the model's
  ``config.hidden_size`` (h*h, 0.9*h*h, 10*h), as Accelerate and the Trainer.

Any other ``"auto"`` left in the config is refused by name (DeepSpeed would
read the string): never a silent difference from Accelerate.

The config's ``optimizer`` and ``scheduler`` sections (Accelerate's
``DummyOptim`` / ``DummyScheduler`` path): given :class:`ConfigOptimizer` /
:class:`ConfigScheduler` where the torch objects would go, ``prepare`` builds the
engine without a torch optimizer, so DeepSpeed builds both from the config; it
returns a :class:`DeepSpeedOptimizer` over DeepSpeed's optimizer and a
:class:`DeepSpeedScheduler` over its schedule (stepped by ``engine.step()``,
once per optimizer step). Their ``"auto"`` values (``lr``, ``weight_decay``,
``warmup_min_lr``, ``warmup_max_lr``, ``warmup_num_steps``, ``total_num_steps``)
are filled from those records, as Accelerate fills them from its dummies.

A value the config states that contradicts one of these is a
:class:`~faccel.errors.DeepSpeedConfigError`, never a silent winner.

The seed loop runs unchanged: ``prepare`` returns the engine as the model and
a :class:`DeepSpeedOptimizer` whose ``step`` is the engine's; ``backward``
finds the engine from the loss's graph and runs the engine's backward with
faccel's micro-step as the accumulation boundary.

Checkpoints, ``save_model`` and ``load_model`` see ZeRO's state as whole
tensors, gathered and scattered by ``_zero_state``. DeepSpeed's own
``save_checkpoint`` (pickle) is never used.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import sys
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from faccel._dist._launch import deepspeed_environment
from faccel._dist._process_group import last_calls
from faccel._dist._state import DistState
from faccel._marks import DEEPSPEED_ENGINE
from faccel.errors import DeepSpeedConfigError, FaccelError, PrepareError, RankFailedError, UsageError

__all__ = [
    "ConfigOptimizer",
    "ConfigScheduler",
    "DeepSpeedOptimizer",
    "DeepSpeedScheduler",
    "engine_backward",
    "fill_config",
    "hidden_size_of",
    "is_deepspeed_engine",
    "prepare_deepspeed",
    "whole_shape",
]

# The values meaning "faccel, fill this in" (Accelerate's and HF Trainer's spelling).
_AUTO = "auto"
# What "auto" gradient clipping means to Accelerate and the HF Trainer (max_grad_norm=1.0).
_AUTO_CLIPPING = 1.0
# ZeRO's sizes that Accelerate and the Trainer derive from the model's hidden size h at "auto".
_HIDDEN_SIZE_KEYS: dict[str, Callable[[int], int]] = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}
# DeepSpeed's optimizers (the config's optimizer.type, lower case) whose ops have no CPU kernel in
# DeepSpeed 0.19: "This op had not been implemented on CPU backend" at the engine's build.
_NO_CPU_KERNEL = {"lamb": "FusedLamb", "lion": "FusedLion"}
# Set on each Parameter of an engine's module: the engine (weakly), for backward() to find
# from the loss's graph. (A mark on user objects, as _prepare's _REPLACED_BY.)
_ENGINE = DEEPSPEED_ENGINE


@attrs.frozen(eq=False)
class ConfigOptimizer:
    """The optimizer the DeepSpeed config's ``optimizer`` section builds (Accelerate's ``DummyOptim``).

    Pass it to :func:`faccel.prepare` where a torch optimizer would go, under
    ``strategy='deepspeed'`` with a config that has an ``optimizer`` section:
    the engine is built without a torch optimizer, DeepSpeed builds its own from
    the section, and ``prepare`` returns a :class:`DeepSpeedOptimizer` over it
    (``step``, ``zero_grad``, checkpoints as with a torch optimizer).

    Args:
        params: The parameters or parameter groups (dicts with ``"params"``)
            DeepSpeed's optimizer steps; None: every parameter of the model, one group.
        lr: Fills ``optimizer.params.lr`` where the config says ``"auto"``
            (and a scheduler's ``warmup_max_lr`` at ``"auto"``).
        weight_decay: Fills ``optimizer.params.weight_decay`` at ``"auto"``.

    Example:
        >>> ConfigOptimizer(lr=1e-3).lr
        0.001
    """

    params: Any = None
    lr: float | None = None
    weight_decay: float | None = None


@attrs.frozen
class ConfigScheduler:
    """The schedule the DeepSpeed config's ``scheduler`` section builds (Accelerate's ``DummyScheduler``).

    Pass it to :func:`faccel.prepare` where a torch LR scheduler would go;
    ``prepare`` returns a :class:`DeepSpeedScheduler`. DeepSpeed steps the
    schedule inside ``optimizer.step()`` (the engine's step), once per optimizer
    step; counts are in optimizer steps (``faccel.steps_per_epoch`` after
    ``prepare``). An Accelerate script's ``DummyScheduler(total_num_steps=T,
    warmup_num_steps=W)`` is ``ConfigScheduler(total_num_steps=ceil(T / N),
    warmup_num_steps=W)`` on N processes: Accelerate divides the total (not the
    warmup) by the number of processes when it fills the config.

    Args:
        warmup_num_steps: Fills ``scheduler.params.warmup_num_steps`` at ``"auto"``.
        total_num_steps: Fills ``scheduler.params.total_num_steps`` at ``"auto"``.

    Example:
        >>> ConfigScheduler(warmup_num_steps=10, total_num_steps=100).total_num_steps
        100
    """

    warmup_num_steps: int | None = None
    total_num_steps: int | None = None


def _given(value: Any) -> bool:
    return value is not None and value != _AUTO


def _agree(config: dict[str, Any], key: str, faccel_value: Any, source: str) -> None:
    value = config.get(key)
    if _given(value) and value != faccel_value:
        msg = (
            f"the deepspeed config says {key}={value!r} but {source} gives {faccel_value!r}; "
            f"remove the key (or set it to 'auto') and faccel fills it, or change {source}"
        )
        raise DeepSpeedConfigError(msg)
    config[key] = faccel_value


def _precision_section(config: dict[str, Any], name: str, wanted: bool, precision: str) -> None:
    section = config.get(name)
    if section is None:
        section = {}
    if not isinstance(section, dict):
        msg = f"the deepspeed config's {name!r} must be a JSON object, got {section!r}"
        raise DeepSpeedConfigError(msg)
    section = dict(section)
    enabled = section.get("enabled")
    if _given(enabled) and bool(enabled) != wanted:
        msg = (
            f"the deepspeed config says {name}.enabled={enabled!r} but dist.precision is "
            f"{precision!r}; set precision in faccel.detect(precision=...) and remove "
            f"{name}.enabled (or set it to 'auto')"
        )
        raise DeepSpeedConfigError(msg)
    section["enabled"] = wanted
    config[name] = section


def _autos(value: Any, where: str = "") -> list[str]:
    """The dotted keys of ``value`` whose value is ``"auto"``."""
    if value == _AUTO:
        return [where]
    if isinstance(value, dict):
        return [key for k, v in value.items() for key in _autos(v, f"{where}.{k}" if where else str(k))]
    return []


def _fill_hidden_sizes(filled: dict[str, Any], hidden_size: int | None) -> None:
    zero = filled.get("zero_optimization")
    if not isinstance(zero, dict):
        return
    asked = [key for key in _HIDDEN_SIZE_KEYS if zero.get(key) == _AUTO]
    if not asked:
        return
    if hidden_size is None:
        msg = (
            f"the deepspeed config sets zero_optimization.{asked[0]} to 'auto', which Accelerate and the "
            "HF Trainer fill from the model's config.hidden_size, and this model has none; state the "
            "value in the config"
        )
        raise DeepSpeedConfigError(msg)
    filled["zero_optimization"] = {**zero, **{key: _HIDDEN_SIZE_KEYS[key](hidden_size) for key in asked}}


def hidden_size_of(model: nn.Module) -> int | None:
    """The model's ``config.hidden_size`` (or the largest of ``config.hidden_sizes``), as Accelerate reads it.

    Example:
        >>> hidden_size_of(torch.nn.Linear(1, 1)) is None
        True
    """
    config = getattr(model, "config", None)
    size = getattr(config, "hidden_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    sizes = getattr(config, "hidden_sizes", None)
    if isinstance(sizes, list | tuple) and sizes and all(isinstance(s, int) for s in sizes):
        return max(sizes)
    return None


def _section(filled: dict[str, Any], name: str) -> dict[str, Any]:
    """The config's ``name`` section with its ``params`` as a fresh dict (a copy, filled in place)."""
    section = filled[name]
    kind = section.get("type") if isinstance(section, dict) else None
    params = section.get("params", {}) if isinstance(section, dict) else None
    if not isinstance(kind, str) or not isinstance(params, dict):
        msg = (
            f"the deepspeed config's {name!r} section must be a JSON object with a 'type' string and a "
            f"'params' object (as DeepSpeed reads it), got {section!r}"
        )
        raise DeepSpeedConfigError(msg)
    section = {**section, "params": dict(params)}
    filled[name] = section
    return section


def _fill_param(
    section: dict[str, Any], where: str, key: str, value: Any, source: str, *, strict: bool = True
) -> None:
    """``section["params"][key]`` from ``value`` where it is ``"auto"``; with ``strict``, a stated
    value that differs from a given one is refused by name (a derived default is not ``strict``)."""
    params = section["params"]
    stated = params.get(key)
    if value is None:
        return
    if strict and _given(stated) and stated != value:
        msg = (
            f"the deepspeed config says {where}.params.{key}={stated!r} but {source} gives {value!r}; "
            f"set it to 'auto' (faccel fills it) or leave {source} unset"
        )
        raise DeepSpeedConfigError(msg)
    if stated == _AUTO:
        params[key] = value


def _optimizer_section(filled: dict[str, Any], dist: DistState, optimizer: Any) -> None:
    """The config's ``optimizer`` section against what ``prepare`` was given; ``"auto"`` filled."""
    if "optimizer" not in filled:
        if isinstance(optimizer, ConfigOptimizer):
            msg = (
                "prepare was given faccel.ConfigOptimizer(), but the deepspeed config has no 'optimizer' "
                "section to build it from; add the section (as Accelerate's DummyOptim needs) or pass a "
                "torch optimizer"
            )
            raise DeepSpeedConfigError(msg)
        return
    if not isinstance(optimizer, ConfigOptimizer):
        given = "none" if optimizer is None else f"a {type(optimizer).__name__}"
        msg = (
            f"the deepspeed config has an 'optimizer' section, so DeepSpeed builds the optimizer, and "
            f"prepare was given {given}; pass faccel.ConfigOptimizer(lr=...) where the torch optimizer "
            "goes (Accelerate's DummyOptim), or remove the section and pass the torch optimizer"
        )
        raise DeepSpeedConfigError(msg)
    section = _section(filled, "optimizer")
    kernel = _NO_CPU_KERNEL.get(section["type"].lower())
    if kernel is not None and dist.device.type == "cpu":
        msg = (
            f"the deepspeed config's optimizer {section['type']!r} is DeepSpeed's {kernel}, whose op has no "
            "CPU kernel (DeepSpeed: 'This op had not been implemented on CPU backend'); on CPU use "
            "'AdamW' (with 'torch_adam': true for torch's own), 'Adam', or a torch.optim name such as "
            "'SGD' or 'Adagrad'"
        )
        raise DeepSpeedConfigError(msg)
    _fill_param(section, "optimizer", "lr", optimizer.lr, "ConfigOptimizer(lr=)")
    _fill_param(
        section, "optimizer", "weight_decay", optimizer.weight_decay, "ConfigOptimizer(weight_decay=)"
    )


def _optimizer_lr(filled: dict[str, Any], optimizer: Any) -> float | None:
    if isinstance(optimizer, ConfigOptimizer):
        lr = filled.get("optimizer", {}).get("params", {}).get("lr")
        return lr if _given(lr) else optimizer.lr
    if isinstance(optimizer, torch.optim.Optimizer):
        return float(optimizer.param_groups[0]["lr"])
    return None


def _scheduler_section(filled: dict[str, Any], optimizer: Any, scheduler: Any) -> None:
    """The config's ``scheduler`` section against what ``prepare`` was given; ``"auto"`` filled."""
    if "scheduler" not in filled:
        if isinstance(scheduler, ConfigScheduler):
            msg = (
                "prepare was given faccel.ConfigScheduler(), but the deepspeed config has no 'scheduler' "
                "section to build it from; add the section (as Accelerate's DummyScheduler needs) or pass "
                "a torch scheduler"
            )
            raise DeepSpeedConfigError(msg)
        return
    if not isinstance(scheduler, ConfigScheduler):
        given = "none" if scheduler is None else f"a {type(scheduler).__name__}"
        msg = (
            f"the deepspeed config has a 'scheduler' section, so DeepSpeed builds and steps the schedule, "
            f"and prepare was given {given}; pass faccel.ConfigScheduler(warmup_num_steps=..., "
            "total_num_steps=...) where the torch scheduler goes (Accelerate's DummyScheduler), or remove "
            "the section"
        )
        raise DeepSpeedConfigError(msg)
    section = _section(filled, "scheduler")
    lr = _optimizer_lr(filled, optimizer)
    _fill_param(section, "scheduler", "warmup_min_lr", 0, "Accelerate's rule", strict=False)
    _fill_param(section, "scheduler", "warmup_max_lr", lr, "the optimizer's lr", strict=False)
    warmup, total = scheduler.warmup_num_steps, scheduler.total_num_steps
    _fill_param(section, "scheduler", "warmup_num_steps", warmup, "ConfigScheduler(warmup_num_steps=)")
    _fill_param(section, "scheduler", "total_num_steps", total, "ConfigScheduler(total_num_steps=)")


def fill_config(
    config: str,
    *,
    dist: DistState,
    micro_batch_size: int | None,
    hidden_size: int | None = None,
    optimizer: ConfigOptimizer | torch.optim.Optimizer | None = None,
    scheduler: ConfigScheduler | object | None = None,
) -> dict[str, Any]:
    """The DeepSpeed config that ``config`` (JSON text) and faccel's own facts make together. Pure.

    Args:
        config: JSON text from :func:`read_config` (``dist.deepspeed``).
        dist: The run's :class:`DistState`: accumulation, precision, world size.
        micro_batch_size: The prepared loader's batch size per rank, or None
            when no loader was prepared with the model (then the config must say it).
        hidden_size: The model's hidden size (:func:`hidden_size_of`), for
            ZeRO's bucket sizes at ``"auto"``.
        optimizer: What ``prepare`` was given for the optimizer: a torch
            optimizer, a :class:`ConfigOptimizer` (the config's ``optimizer``
            section builds it) or None.
        scheduler: What ``prepare`` was given for the scheduler: a torch
            scheduler, a :class:`ConfigScheduler` or None.

    Returns:
        The config dict to build the engine from.

    Raises:
        DeepSpeedConfigError: A stated value contradicts faccel's, the
            config's ``optimizer`` or ``scheduler`` section and what
            ``prepare`` was given disagree (a section without its
            :class:`ConfigOptimizer` / :class:`ConfigScheduler`, or one of
            those without its section, or a torch object beside a section),
            the section names an optimizer that cannot run on this device,
            the ZeRO stage is not 0-3, no micro-batch size is known, or an
            ``"auto"`` is left that faccel cannot fill as Accelerate would (named).

    Example:
        >>> dist = DistState.simulated(world_size=2, accumulation_steps=3, precision="bf16")
        >>> c = fill_config('{"zero_optimization": {"stage": 2}}', dist=dist, micro_batch_size=4)
        >>> (c["train_micro_batch_size_per_gpu"], c["gradient_accumulation_steps"],
        ...  c["train_batch_size"], c["bf16"]["enabled"], c["fp16"]["enabled"], c["gradient_clipping"])
        (4, 3, 24, True, False, 0.0)
        >>> fill_config('{"gradient_clipping": "auto"}', dist=dist, micro_batch_size=4)["gradient_clipping"]
        1.0
        >>> fill_config('{"gradient_accumulation_steps": 2}', dist=dist, micro_batch_size=4)
        Traceback (most recent call last):
        ...
        faccel.errors.DeepSpeedConfigError: the deepspeed config says gradient_accumulation_steps=2 ...
    """
    filled: dict[str, Any] = json.loads(config)
    _optimizer_section(filled, dist, optimizer)
    _scheduler_section(filled, optimizer, scheduler)
    zero = filled.get("zero_optimization", {})
    stage = zero.get("stage", 0) if isinstance(zero, dict) else None
    if stage not in (0, 1, 2, 3):
        msg = f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}"
        raise DeepSpeedConfigError(msg)
    if micro_batch_size is None:
        micro_batch_size = filled.get("train_micro_batch_size_per_gpu")
        if not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool):
            msg = (
                "no loader was prepared with the model, so faccel cannot fill "
                "train_micro_batch_size_per_gpu; prepare the model, optimizer and loader in one "
                "faccel.prepare call, or state the size in the deepspeed config"
            )
            raise DeepSpeedConfigError(msg)
    _agree(filled, "train_micro_batch_size_per_gpu", micro_batch_size, "the prepared loader's batch size")
    _agree(filled, "gradient_accumulation_steps", dist.accumulation_steps, "dist.accumulation_steps")
    total = micro_batch_size * dist.accumulation_steps * dist.data_world_size
    _agree(filled, "train_batch_size", total, "batch size x accumulation steps x world size")
    _precision_section(filled, "fp16", dist.precision == "fp16", dist.precision)
    _precision_section(filled, "bf16", dist.precision == "bf16", dist.precision)
    clip = filled.get("gradient_clipping")
    if clip == _AUTO:
        clip = (
            _AUTO_CLIPPING  # what "auto" means to Accelerate and the HF Trainer: the same JSON, the same run
        )
    elif clip is None:
        clip = 0.0  # left out: nothing is clipped that the user did not ask for
    if not isinstance(clip, int | float) or isinstance(clip, bool) or not math.isfinite(clip) or clip < 0:
        msg = f"gradient_clipping must be a number >= 0 (0: no clipping), got {clip!r}"
        raise DeepSpeedConfigError(msg)
    filled["gradient_clipping"] = float(clip)
    _fill_hidden_sizes(filled, hidden_size)
    left = _autos(filled)
    if left:
        msg = (
            f"the deepspeed config leaves {', '.join(left)} at 'auto', which faccel does not fill "
            "(it fills the batch sizes, accumulation, fp16/bf16, gradient_clipping, ZeRO's "
            "hidden-size buckets, and the optimizer's and scheduler's from the values given to "
            "faccel.ConfigOptimizer / ConfigScheduler, as Accelerate does); state the value in the config "
            "or give it to those"
        )
        raise DeepSpeedConfigError(msg)
    # A torch optimizer (AdamW, SGD...) is "untested" for DeepSpeed's ZeRO; it works exactly.
    filled.setdefault("zero_allow_untested_optimizer", True)
    filled.setdefault("steps_per_print", 2**31 - 1)  # faccel's trackers log; DeepSpeed stays quiet
    filled.setdefault("wall_clock_breakdown", False)
    return filled


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
