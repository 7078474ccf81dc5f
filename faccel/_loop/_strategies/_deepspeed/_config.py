"""DeepSpeed's config as faccel completes it: a value, filled from what faccel knows (pure).

The config is a value: :func:`faccel._dist._deepspeed_config.read_config` turns a dict or a JSON
file into canonical JSON text that ``DistState.deepspeed`` holds, and :func:`fill_config` completes
it with what faccel knows (docs/deepspeed.md):

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
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch import nn

from faccel._dist._state import DistState
from faccel.errors import DeepSpeedConfigError

__all__ = ["ConfigOptimizer", "ConfigScheduler", "fill_config", "hidden_size_of"]

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
