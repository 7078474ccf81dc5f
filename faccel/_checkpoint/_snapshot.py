"""A TrainState as JSON plus tensors, and back: every check made before anything is loaded.

:func:`capture` turns the live objects into ``state.json``'s content and the
tensors of three safetensors files, without copying a tensor.
:func:`check` decodes a checkpoint's content against the objects it is meant
for and lists every mismatch at once; only then does :func:`load` touch the
objects. The random generators (Python, NumPy, torch, CUDA) are per process:
:func:`capture_rng` and the RNG half of :func:`check`/:func:`load`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch

from faccel._checkpoint._sharded_state import load_full_state
from faccel._checkpoint._tagged_json import TensorSink, decode, encode, tensor_refs
from faccel._checkpoint._weights import alias_groups, compare_tensors, model_tensors
from faccel._model import is_sharded, unwrap_model
from faccel._state import DistState
from faccel._train_state import TrainState
from faccel.errors import CheckpointError

__all__ = [
    "EXTRAS",
    "MODEL",
    "OPTIMIZER",
    "STATE",
    "Loadable",
    "capture",
    "capture_rng",
    "check",
    "check_rng",
    "load",
]

STATE = "state.json"
MODEL = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
EXTRAS = "extras.safetensors"
_STATE_FORMAT = "faccel.checkpoint.state"
_RNG_FORMAT = "faccel.checkpoint.rng"

# Built-in optimizers whose non-scalar state tensors have their parameter's shape and dtype.
_ELEMENTWISE = frozenset(
    f"torch.optim.{name}"
    for name in (
        "sgd.SGD",
        "adam.Adam",
        "adamw.AdamW",
        "adagrad.Adagrad",
        "adadelta.Adadelta",
        "adamax.Adamax",
        "nadam.NAdam",
        "radam.RAdam",
        "rmsprop.RMSprop",
        "rprop.Rprop",
        "asgd.ASGD",
    )
)


def _class_name(obj: object) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _is_stateful(value: object) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def capture(
    dist: DistState,
    state: TrainState,
    whole: tuple[Mapping[str, Any], Mapping[str, Any] | None] | None = None,
) -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]]:
    """``state.json``'s content and each safetensors file's tensors, for ``state``.

    Tensors are the live ones (no copy): write them before training goes on.
    ``whole``: an FSDP2 model's gathered model and optimizer state dicts, which
    are stored exactly as an unsharded model's would be.
    """
    model_state = None if whole is None else whole[0]
    optimizer_state: Any = whole[1] if whole is not None else None
    if whole is None and state.optimizer is not None:
        optimizer_state = state.optimizer.state_dict()
    stored, aliases = model_tensors(state.model, model_state)
    optimizer_sink = TensorSink(file=OPTIMIZER)
    extras_sink = TensorSink(file=EXTRAS)
    scheduler = state.scheduler
    scaler = state.scaler
    extras: dict[str, Any] = {}
    for name, value in state.extras.items():
        stateful = _is_stateful(value)
        encoded = encode(value.state_dict() if stateful else value, sink=extras_sink, path=f"extras.{name}")
        extras[name] = {"kind": "stateful" if stateful else "value", "value": encoded}
    content = {
        "format": _STATE_FORMAT,
        "step": state.step,
        "epoch": state.epoch,
        "position": state.position,
        "world_size": dist.world_size,
        "model": {
            "keys": list(unwrap_model(state.model).state_dict() if model_state is None else model_state),
            "aliases": aliases,
        },
        "optimizer": None
        if state.optimizer is None
        else {
            "class": _class_name(state.optimizer),
            "state_dict": encode(optimizer_state, sink=optimizer_sink),
        },
        "scheduler": None
        if scheduler is None
        else {
            "class": _class_name(scheduler),
            "state_dict": encode(scheduler.state_dict(), sink=extras_sink, path="scheduler"),
        },
        "scaler": None
        if scaler is None
        else {"state_dict": encode(scaler.state_dict(), sink=extras_sink, path="scaler")},
        "extras": extras,
    }
    files = {MODEL: stored, OPTIMIZER: optimizer_sink.tensors, EXTRAS: extras_sink.tensors}
    return content, files


def capture_rng(dist: DistState) -> dict[str, Any]:
    """This process's random generators as tagged JSON (torch states inline, base64)."""
    cuda = torch.cuda.get_rng_state_all() if dist.device.type == "cuda" else None
    return {
        "format": _RNG_FORMAT,
        "rank": dist.rank,
        "python": encode(random.getstate()),
        "numpy": encode(np.random.get_state(legacy=False)),
        "torch": encode(torch.get_rng_state()),
        "cuda": None if cuda is None else encode(cuda),
    }


@attrs.frozen(kw_only=True)
class Loadable:
    """A checkpoint's content, decoded and checked against its target objects."""

    step: int
    epoch: int
    position: int
    model: Mapping[str, torch.Tensor]
    optimizer: Mapping[str, Any]
    scheduler: Mapping[str, Any] | None
    scaler: Mapping[str, Any] | None
    extras: Mapping[str, Any]


_SHOWN = 12  # problems listed in one message; a wrong architecture would list every tensor


class _Problems:
    """Mismatches gathered per file, raised together as one CheckpointError."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.items: list[str] = []

    def add(self, file: str, what: str) -> None:
        self.items.append(f"{file}: {what}")

    def raise_if_any(self) -> None:
        if self.items:
            shown = self.items[:_SHOWN]
            more = f"; and {len(self.items) - _SHOWN} more" if len(self.items) > _SHOWN else ""
            msg = f"checkpoint {self.where} does not fit the objects given: " + "; ".join(shown) + more
            raise CheckpointError(msg)


def _int_field(content: Mapping[str, Any], key: str, problems: _Problems) -> int:
    value = content.get(key)
    if type(value) is not int or value < 0:
        problems.add(STATE, f"{key} must be an int >= 0, got {value!r}")
        return 0
    return value


def check(
    dist: DistState,
    state: TrainState,
    content: Any,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    where: str,
) -> Loadable:
    """Decode ``content`` (``state.json``) and ``tensors`` and check them against ``state``.

    Raises one :class:`CheckpointError` listing every problem; touches nothing.
    """
    problems = _Problems(where)
    if not isinstance(content, dict) or content.get("format") != _STATE_FORMAT:
        problems.add(STATE, f"not a faccel checkpoint state (format should be {_STATE_FORMAT!r})")
        problems.raise_if_any()
    for file, refs in _refs_by_file(content).items():
        held = set(tensors.get(file, {}))
        if file not in tensors:
            problems.add(STATE, f"refers to tensors of {file}, which is not part of a checkpoint")
            continue
        for key in sorted(refs - held):
            problems.add(file, f"tensor {key!r} is missing")
        for key in sorted(held - refs):
            problems.add(
                file, f"holds tensor {key!r}, which state.json does not mention (foreign or altered)"
            )
    problems.raise_if_any()

    def decoded(value: Any) -> Any:
        return decode(value, tensors=tensors, where=f"{where}/{STATE}")

    model = _check_model(state, content.get("model"), tensors[MODEL], problems)
    optimizer = _check_optimizer(state, content.get("optimizer"), decoded, problems)
    scheduler = _check_scheduler(state, content.get("scheduler"), decoded, problems)
    scaler = _check_scaler(state, content.get("scaler"), decoded, problems)
    extras = _check_extras(state, content.get("extras"), decoded, problems)
    step = _int_field(content, "step", problems)
    epoch = _int_field(content, "epoch", problems)
    position = _int_field(content, "position", problems)
    problems.raise_if_any()
    return Loadable(
        step=step,
        epoch=epoch,
        position=position,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        extras=extras,
    )


def _refs_by_file(content: Mapping[str, Any]) -> dict[str, set[str]]:
    refs: dict[str, set[str]] = {OPTIMIZER: set(), EXTRAS: set()}
    for part in ("optimizer", "scheduler", "scaler", "extras"):
        for file, key in tensor_refs(content.get(part)):
            refs.setdefault(file, set()).add(key)
    return refs


def _check_model(
    state: TrainState, section: Any, stored: Mapping[str, torch.Tensor], problems: _Problems
) -> dict[str, torch.Tensor]:
    if (
        not isinstance(section, dict)
        or not isinstance(section.get("keys"), list)
        or not isinstance(section.get("aliases"), dict)
        or not all(isinstance(k, str) for k in section["keys"])
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in section["aliases"].items())
    ):
        problems.add(STATE, "model needs keys (a list of names) and aliases (names to names)")
        return {}
    aliases: dict[str, str] = section["aliases"]
    keys: list[str] = section["keys"]
    for key in keys:
        if key not in aliases and key not in stored:
            problems.add(MODEL, f"tensor {key!r} is missing")
    for key in stored:
        if key not in keys or key in aliases:
            problems.add(MODEL, f"holds tensor {key!r}, which state.json does not list")
    saved: dict[str, torch.Tensor] = {}
    for key in keys:
        tensor = stored.get(aliases.get(key, key))
        if tensor is not None:
            saved[key] = tensor
    target = unwrap_model(state.model).state_dict()
    specs = {key: (tensor.dtype, tuple(tensor.shape)) for key, tensor in saved.items()}
    _, _, mismatches = compare_tensors(specs, target, strict=True)
    for mismatch in mismatches:
        problems.add(MODEL, mismatch)
    # A name the target ties to a saved one takes the saved tensor (load_state_dict is strict).
    target_aliases = alias_groups(target)
    for name in target:
        if name not in saved:
            tied = [k for k in target if target_aliases.get(k, k) == target_aliases.get(name, name)]
            found = next((k for k in tied if k in saved), None)
            if found is not None:
                saved[name] = saved[found]
    return saved


def _check_optimizer(
    state: TrainState, section: Any, decoded: Callable[[Any], Any], problems: _Problems
) -> dict[str, Any]:
    target = state.optimizer
    if target is None or section is None:
        # Functional training keeps its optimizer state in extras: no torch optimizer.
        if (target is None) != (section is None):
            saved_kind = "no optimizer" if section is None else "an optimizer"
            target_kind = "none" if target is None else "one"
            problems.add(STATE, f"{saved_kind} was saved, and the target has {target_kind}")
        return {}
    if not isinstance(section, dict) or "state_dict" not in section:
        problems.add(STATE, "optimizer section is missing")
        return {}
    if section.get("class") != _class_name(target):
        problems.add(STATE, f"the optimizer is a {section.get('class')}, the target a {_class_name(target)}")
        return {}
    saved = decoded(section["state_dict"])
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    entries = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(entries, dict):
        problems.add(STATE, "the optimizer state needs param_groups (a list) and state (a dict)")
        return {}
    if len(groups) != len(target.param_groups):
        problems.add(
            STATE, f"{len(groups)} optimizer param groups saved, the target has {len(target.param_groups)}"
        )
        return saved
    params: dict[int, torch.Tensor] = {}
    for number, (group, live) in enumerate(zip(groups, target.param_groups, strict=True)):
        ids = group.get("params") if isinstance(group, dict) else None
        if not isinstance(ids, list) or not all(type(i) is int for i in ids):
            problems.add(STATE, f"param group {number} has no list of parameter ids")
            continue
        if len(ids) != len(live["params"]):
            problems.add(
                STATE,
                f"param group {number} has {len(ids)} parameters saved, {len(live['params'])} in the target",
            )
            continue
        saved_keys, live_keys = set(group) - {"params"}, set(live) - {"params"}
        if saved_keys != live_keys:
            problems.add(
                STATE,
                f"param group {number}: hyperparameters {sorted(saved_keys - live_keys)} were saved but "
                f"the target lacks them, {sorted(live_keys - saved_keys)} the other way round (LR "
                "schedulers add keys such as initial_lr: create the same scheduler before restoring)",
            )
        params.update(zip(ids, live["params"], strict=True))
    elementwise = _class_name(target) in _ELEMENTWISE
    for pid, entry in entries.items():
        param = params.get(pid)
        if param is None or not isinstance(entry, dict):
            problems.add(STATE, f"optimizer state for parameter id {pid!r}, which no param group holds")
            continue
        for key, value in entry.items():
            if (
                elementwise
                and isinstance(value, torch.Tensor)
                and value.dim() > 0
                and (value.shape != param.shape or value.dtype != param.dtype)
            ):
                problems.add(
                    OPTIMIZER,
                    f"state {key!r} of parameter {pid} is {value.dtype} {list(value.shape)}, "
                    f"the parameter is {param.dtype} {list(param.shape)}",
                )
    return saved


def _same_keys(saved: Any, live: Mapping[str, Any], what: str, problems: _Problems) -> bool:
    if not isinstance(saved, dict):
        problems.add(STATE, f"the {what} state is not a dict")
        return False
    if set(saved) != set(live):
        problems.add(
            STATE,
            f"the {what} state has keys {sorted(map(str, saved))}, the target {sorted(map(str, live))}",
        )
        return False
    return True


def _check_scheduler(
    state: TrainState, section: Any, decoded: Callable[[Any], Any], problems: _Problems
) -> dict[str, Any] | None:
    target = state.scheduler
    if (section is None) != (target is None):
        problems.add(
            STATE,
            f"a scheduler was {'not ' if section is None else ''}saved, the target has "
            f"{'one' if target is not None else 'none'}",
        )
        return None
    if section is None or target is None:
        return None
    if not isinstance(section, dict) or section.get("class") != _class_name(target):
        problems.add(
            STATE,
            f"the scheduler is a {section.get('class') if isinstance(section, dict) else '?'}, "
            f"the target a {_class_name(target)}",
        )
        return None
    saved = decoded(section.get("state_dict"))
    return saved if _same_keys(saved, target.state_dict(), "scheduler", problems) else None


def _check_scaler(
    state: TrainState, section: Any, decoded: Callable[[Any], Any], problems: _Problems
) -> dict[str, Any] | None:
    target = state.scaler
    if (section is None) != (target is None):
        problems.add(
            STATE,
            f"a grad scaler was {'not ' if section is None else ''}saved, the target has "
            f"{'one' if target is not None else 'none'}",
        )
        return None
    if section is None or target is None:
        return None
    saved = decoded(section.get("state_dict") if isinstance(section, dict) else None)
    # A disabled scaler's state is {}: both must be enabled, or both disabled.
    return saved if _same_keys(saved, target.state_dict(), "grad scaler", problems) else None


def _check_extras(
    state: TrainState, section: Any, decoded: Callable[[Any], Any], problems: _Problems
) -> dict[str, Any]:
    if not isinstance(section, dict):
        problems.add(STATE, "extras must be a JSON object")
        return {}
    saved_names, live_names = set(section), set(state.extras)
    if saved_names != live_names:
        problems.add(
            STATE,
            f"extras {sorted(saved_names - live_names)} saved but not in the target, "
            f"{sorted(live_names - saved_names)} in the target but not saved; "
            "give the TrainState the same extras names (any placeholder value) as when saving",
        )
        return {}
    out: dict[str, Any] = {}
    for name in sorted(section):
        entry, live = section[name], state.extras[name]
        stateful = _is_stateful(live)
        if not isinstance(entry, dict) or entry.get("kind") != ("stateful" if stateful else "value"):
            problems.add(
                STATE,
                f"extras[{name!r}] was saved as {entry.get('kind') if isinstance(entry, dict) else '?'}"
                f", the target is {'an object with state_dict' if stateful else 'a value'}",
            )
            continue
        value = decoded(entry.get("value"))
        reference = live.state_dict() if stateful else live
        if (
            stateful
            and isinstance(reference, Mapping)
            and not _same_keys(value, reference, f"extras[{name!r}]", problems)
        ):
            continue
        _match_tensors(value, reference, f"extras[{name!r}]", problems)
        out[name] = value
    return out


def _match_tensors(saved: Any, live: Any, path: str, problems: _Problems) -> None:
    """Where the target holds a tensor, the saved value must be one of the same shape and dtype."""
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            problems.add(
                STATE, f"{path} is a tensor in the target, a {type(saved).__name__} in the checkpoint"
            )
        elif saved.shape != live.shape or saved.dtype != live.dtype:
            problems.add(
                EXTRAS,
                f"{path} is {saved.dtype} {list(saved.shape)} saved, "
                f"{live.dtype} {list(live.shape)} in the target",
            )
    elif isinstance(live, Mapping) and isinstance(saved, Mapping):
        for key in live.keys() & saved.keys():
            _match_tensors(saved[key], live[key], f"{path}[{key!r}]", problems)
    elif isinstance(live, list | tuple) and isinstance(saved, list | tuple) and len(live) == len(saved):
        for index, (s, v) in enumerate(zip(saved, live, strict=True)):
            _match_tensors(s, v, f"{path}[{index}]", problems)


def _placed(saved: Any, live: Any) -> Any:
    """``saved`` with each tensor moved to the device of the target's tensor at the same place."""
    if isinstance(live, torch.Tensor) and isinstance(saved, torch.Tensor):
        return saved.to(live.device)
    if isinstance(live, Mapping) and isinstance(saved, dict):
        return {key: _placed(value, live[key]) if key in live else value for key, value in saved.items()}
    if isinstance(live, list | tuple) and isinstance(saved, list | tuple) and len(live) == len(saved):
        return type(saved)(_placed(s, v) for s, v in zip(saved, live, strict=True))
    return saved


def check_rng(dist: DistState, content: Any, *, where: str) -> dict[str, Any]:
    """Decode and check one rank's RNG file; returns the states to set."""
    problems = _Problems(where)
    file = where.rsplit("/", 1)[-1]
    if not isinstance(content, dict) or content.get("format") != _RNG_FORMAT:
        problems.add(file, f"not a faccel RNG state (format should be {_RNG_FORMAT!r})")
        problems.raise_if_any()
    states = {
        key: decode(content.get(key), tensors={}, where=where) for key in ("python", "numpy", "torch", "cuda")
    }
    if content.get("rank") != dist.rank:
        problems.add(file, f"holds rank {content.get('rank')!r}'s generators, this is rank {dist.rank}")
    trials: list[tuple[str, Callable[[], object]]] = [
        ("python", lambda: random.Random().setstate(states["python"])),
        ("numpy", lambda: np.random.RandomState().set_state(states["numpy"])),
        ("torch", lambda: torch.Generator().set_state(states["torch"])),
    ]
    for name, trial in trials:
        try:  # a throwaway generator takes the state first: the live ones stay untouched
            trial()
        except Exception as error:  # any refusal means the state is unusable
            problems.add(file, f"the {name} generator state is invalid ({error})")
    cuda = states["cuda"]
    on_cuda = dist.device.type == "cuda"
    if (cuda is not None) != on_cuda:
        problems.add(
            file,
            f"CUDA generator states were {'' if cuda is not None else 'not '}saved, and this process "
            f"computes on {dist.device}; resume on the kind of device that wrote the checkpoint",
        )
    elif cuda is not None and (not isinstance(cuda, list) or len(cuda) != torch.cuda.device_count()):
        problems.add(
            file,
            f"CUDA states of {len(cuda) if isinstance(cuda, list) else '?'} devices saved, "
            f"this process sees {torch.cuda.device_count()}",
        )
    problems.raise_if_any()
    return states


def load(state: TrainState, loadable: Loadable, rng: Mapping[str, Any] | None) -> TrainState:
    """Load a checked checkpoint into ``state``'s objects (in place) and set the generators.

    Returns a new TrainState with the saved step, epoch, position and extras.
    ``rng`` is None for a rank the checkpoint has no generators of (resharding
    to more ranks): its generators are left as they are.
    """
    model = unwrap_model(state.model)
    if is_sharded(model):
        # A collective: every rank scatters the whole tensors into its own shards.
        load_full_state(model, state.optimizer, loadable.model, loadable.optimizer)
    else:
        with torch.no_grad():
            model.load_state_dict(dict(loadable.model), strict=True)
        if state.optimizer is not None:
            state.optimizer.load_state_dict(dict(loadable.optimizer))
    if state.scheduler is not None and loadable.scheduler is not None:
        state.scheduler.load_state_dict(dict(loadable.scheduler))
    if state.scaler is not None and loadable.scaler:
        state.scaler.load_state_dict(dict(loadable.scaler))
    extras: dict[str, Any] = {}
    for name, live in state.extras.items():
        value = loadable.extras[name]
        if _is_stateful(live):
            live.load_state_dict(_placed(value, live.state_dict()))
            extras[name] = live
        else:
            extras[name] = _placed(value, live)
    if rng is not None:
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state_all(rng["cuda"])
    return attrs.evolve(
        state, step=loadable.step, epoch=loadable.epoch, position=loadable.position, extras=extras
    )
