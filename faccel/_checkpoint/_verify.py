"""Every check of a checkpoint, made before anything is loaded.

:func:`check_manifest` checks the manifest (format, version, world size, the
file list) before the other files are read; each file's size and SHA-256 are
checked as it is read (``_durable``). :func:`check` decodes ``state.json``
and the tensors against the objects they are meant for, and :func:`check_rng`
one rank's generator file: each lists every mismatch in one
:class:`CheckpointError`, or returns what ``_load`` may load. Nothing here
touches a live object.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch
from torch import nn

from faccel._checkpoint._capture import class_name, class_names, is_stateful
from faccel._checkpoint._format import (
    EXTRAS,
    MODEL,
    OPTIMIZER,
    STATE,
)
from faccel._checkpoint._manifest import Manifest
from faccel._checkpoint._stage import load_problem, stand_ins
from faccel._checkpoint._state_file import Extra, Generators, RngFile, Section, StateFile
from faccel._checkpoint._strategies import strategy_of
from faccel._dist._state import DistState
from faccel._loop._strategies import unwrap_model
from faccel._storage._durable import FileRecord
from faccel._storage._tagged_json import decode, tensor_refs
from faccel._storage._weights import alias_groups, compare_tensors
from faccel._train_state import TrainState
from faccel._tree import MISSING, paired_leaves
from faccel.errors import CheckpointError

__all__ = ["Loadable", "check", "check_manifest", "check_rng"]


def _check_data_world(manifest: Manifest, dist: DistState, where: str) -> None:
    """Refuse a position inside an epoch that counts batches of another number of data-parallel ranks.

    Under a layout with tensor parallelism the loaders deal over fewer ranks
    than the world has (``dist.data_world_size``); the manifest records that
    number when it differs from the world size. (Another world size is
    checked with the rest of the state, by the restore.)
    """
    data_world, position = manifest.data_world, manifest.position
    if (
        manifest.world_size == dist.world_size
        and data_world != dist.data_world_size
        and position not in (0, None)
    ):
        msg = (
            f"{where}: written with {data_world} data-parallel ranks at batch {position} of epoch "
            f"{manifest.epoch}, restored with {dist.data_world_size} (layout {dist.parallel}): "
            "a position inside an epoch counts batches of the data-parallel ranks that wrote it, so it "
            "cannot be carried over exactly. Resume in a layout with as many data-parallel ranks "
            "(replicate x shard), or from a checkpoint written at an epoch boundary"
        )
        raise CheckpointError(msg)


def check_manifest(
    manifest: Manifest, dist: DistState, model: nn.Module, *, where: str
) -> tuple[dict[str, FileRecord], int, int]:
    """Check a decoded manifest (format, version, world size and files checked by
    :meth:`Manifest.decode`) against this run: the data-parallel ranks a position inside an epoch counts.

    Returns each listed file's record (size and digest, checked as the file
    is read), the world size that wrote the checkpoint, and its format version
    (1 and 3: whole tensors, with SHA-256 and BLAKE3 records; 2: sharded).
    """
    _check_data_world(manifest, dist, where)
    return dict(manifest.files), manifest.world_size, manifest.version


def elementwise_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is a built-in whose non-scalar state tensors have their parameter's shape.

    Example:
        >>> import torch
        >>> p = [torch.nn.Parameter(torch.ones(2))]
        >>> elementwise_optimizer(torch.optim.AdamW(p)), elementwise_optimizer(object())
        (True, False)
    """
    return type(optimizer) in _ELEMENTWISE


# Built-in optimizers whose non-scalar state tensors have their parameter's shape and dtype: the
# classes themselves (a subclass may keep other state, so only these exact types).
_ELEMENTWISE: frozenset[type] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Rprop,
        torch.optim.ASGD,
    }
)


@attrs.frozen(kw_only=True)
class Loadable:
    """A checkpoint's content, decoded and checked against its target objects.

    Every load_state_dict it calls for has been tried on throwaway copies of
    the objects (``_stage``): loading it into them succeeds.
    """

    where: str
    step: int
    epoch: int
    position: int
    # Positions of the epoch's order all ranks had read (None: saved without TrainState.loader),
    # and TrainState.resumed_at; both only from checkpoints that record them.
    consumed: int | None = None
    resumed_at: tuple[int, int] | None = None
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


def check(
    dist: DistState,
    state: TrainState,
    content: StateFile,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    *,
    where: str,
) -> Loadable:
    """Decode ``content`` (``state.json``'s record, its shape checked by :meth:`StateFile.decode`)
    and ``tensors`` and check them against ``state``.

    Raises one :class:`CheckpointError` listing every problem; touches nothing.
    """
    problems = _Problems(where)
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

    model = _check_model(state, content, tensors[MODEL], problems)
    optimizer = _check_optimizer(state, content.optimizer, decoded, problems)
    scheduler = _check_scheduler(state, content.scheduler, decoded, problems)
    scaler = _check_scaler(state, content.scaler, decoded, problems)
    extras = _check_extras(state, content.extras, decoded, problems)
    problems.raise_if_any()
    _stage(state, model, optimizer, scheduler, scaler, extras, problems)
    problems.raise_if_any()
    return Loadable(
        where=where,
        step=content.step,
        epoch=content.epoch,
        position=content.position,
        consumed=content.consumed,
        resumed_at=content.resumed_at,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
        extras=extras,
    )


def _objects(state: TrainState) -> list[Any]:
    """Every stateful object of ``state``: what a throwaway copy may reach."""
    found = [unwrap_model(state.model), state.optimizer, state.scheduler, state.scaler]
    found += [value for value in (*state.extras.values(), *state.rank_extras.values()) if is_stateful(value)]
    return [obj for obj in found if obj is not None]


def _stage(
    state: TrainState,
    model: Mapping[str, torch.Tensor],
    optimizer: Mapping[str, Any],
    scheduler: Mapping[str, Any] | None,
    scaler: Mapping[str, Any] | None,
    extras: Mapping[str, Any],
    problems: _Problems,
) -> None:
    """Try every load of the restore on throwaway copies (``_stage``); list what refuses."""
    stand_in = stand_ins(_objects(state))
    trials: list[tuple[str, Any, Any]] = [
        (f"extras[{name!r}]", state.extras[name], value)
        for name, value in extras.items()
        if is_stateful(state.extras[name])
    ]
    trials += [("scaler", state.scaler, scaler), ("scheduler", state.scheduler, scheduler)]
    # What loads through collectives (FSDP2's model, DeepSpeed's model and optimizer) is not tried:
    # its shapes are checked (a DeepSpeed optimizer's whole-tensor state too, in _check_optimizer).
    staged = strategy_of(state.model).staged
    if "optimizer" in staged:
        trials.append(("optimizer", state.optimizer, optimizer))
    if "model" in staged:
        trials.append(("model", unwrap_model(state.model), model))
    for field, obj, saved in trials:
        if obj is None or saved is None or (field == "scaler" and not saved):
            continue
        refused = load_problem(obj, saved, stand_in)
        if refused is not None:
            target_kind = class_name(obj)
            problems.add(
                STATE, f"{field}: the saved state does not load into the target's {target_kind} ({refused})"
            )


def _refs_by_file(content: StateFile) -> dict[str, set[str]]:
    refs: dict[str, set[str]] = {OPTIMIZER: set(), EXTRAS: set()}
    sections = [content.optimizer, content.scheduler, content.scaler]
    trees = [s.state_dict for s in sections if s is not None] + [e.value for e in content.extras.values()]
    for tree in trees:
        for file, key in tensor_refs(tree):
            refs.setdefault(file, set()).add(key)
    return refs


def model_target(state: TrainState) -> dict[str, torch.Tensor]:
    """The state dict a checkpoint's model must fit (the strategy's: a DeepSpeed ZeRO-3 parameter's
    whole shape)."""
    return strategy_of(state.model).target(state.model)


def _check_model(
    state: TrainState, content: StateFile, stored: Mapping[str, torch.Tensor], problems: _Problems
) -> dict[str, torch.Tensor]:
    aliases = content.model_aliases
    keys = list(content.model_keys)
    ownership = strategy_of(state.model).ownership(state.model)
    if ownership.model_names is not None:  # the union of the stages is the whole model: every rank checks it
        for key in sorted(set(keys) - ownership.model_names - set(aliases)):
            problems.add(MODEL, f"holds tensor {key!r}, which no pipeline stage of the model holds")
        for key in sorted(ownership.model_names - set(keys)):
            problems.add(MODEL, f"tensor {key!r} of the model (another stage's) is missing")
    if not ownership.every_name:  # a rank that holds some names (a pipeline stage) checks those only
        keys = [key for key in keys if ownership.owns(key)]
        stored = {key: tensor for key, tensor in stored.items() if ownership.owns(key)}
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
    target = model_target(state)
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
    state: TrainState, section: Section | None, decoded: Callable[[Any], Any], problems: _Problems
) -> dict[str, Any]:
    target = state.optimizer
    if target is None or section is None:
        # Functional training keeps its optimizer state in extras: no torch optimizer.
        if (target is None) != (section is None):
            saved_kind = "no optimizer" if section is None else "an optimizer"
            target_kind = "none" if target is None else "one"
            problems.add(STATE, f"{saved_kind} was saved, and the target has {target_kind}")
        return {}
    if section.class_name not in class_names(target):
        problems.add(STATE, f"the optimizer is a {section.class_name}, the target a {class_name(target)}")
        return {}
    saved = decoded(section.state_dict)
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    entries = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(entries, dict):
        problems.add(STATE, "the optimizer state needs param_groups (a list) and state (a dict)")
        return {}
    # A DeepSpeed run's groups hold ZeRO's flat partitions: its checkpoint numbers the model's
    # parameters (whole shapes, float32 state) as the torch optimizer held them before ZeRO.
    strategy = strategy_of(state.model)
    live_groups, inner = strategy.optimizer_view(target)
    if len(groups) != len(live_groups):
        problems.add(STATE, f"{len(groups)} optimizer param groups saved, the target has {len(live_groups)}")
        return saved
    params = _check_param_groups(groups, live_groups, problems)
    elementwise = type(inner) in _ELEMENTWISE
    for pid, entry in entries.items():
        param = params.get(pid)
        if param is None or not isinstance(entry, dict):
            problems.add(STATE, f"optimizer state for parameter id {pid!r}, which no param group holds")
            continue
        if not strategy.owns_param(param):
            continue  # another pipeline stage's: its rank checks it
        for key, value in entry.items():
            _check_state_entry(target, pid, param, key, value, elementwise=elementwise, problems=problems)
    return saved


def _check_param_groups(
    groups: list[Any], live_groups: list[dict[str, Any]], problems: _Problems
) -> dict[int, torch.Tensor]:
    """Each saved param group against the live one: its parameter ids, their count, and its
    hyperparameters' names and kinds. Returns the live parameter of each saved id."""
    params: dict[int, torch.Tensor] = {}
    for number, (group, live) in enumerate(zip(groups, live_groups, strict=True)):
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
        else:
            for key in sorted(saved_keys, key=str):
                _check_kind(group[key], live[key], f"param group {number}'s {key!r}", problems)
        params.update(zip(ids, live["params"], strict=True))
    return params


def _check_state_entry(
    target: Any,
    pid: Any,
    param: torch.Tensor,
    key: str,
    value: Any,
    *,
    elementwise: bool,
    problems: _Problems,
) -> None:
    """One saved per-parameter state value (``exp_avg``, ``step``): a tensor not read because it fits
    nothing of the target, or, for a built-in optimizer, a value of the wrong kind or shape."""
    if isinstance(value, torch.Tensor) and value.is_meta:  # not read: it fits nothing of the target
        live = target.state.get(param, {}).get(key)
        found = (
            f"the target's is {live.dtype} {list(live.shape)}"
            if isinstance(live, torch.Tensor)
            else f"the parameter is {param.dtype} {list(param.shape)}"
        )
        problems.add(
            OPTIMIZER, f"state {key!r} of parameter {pid} is {value.dtype} {list(value.shape)}, {found}"
        )
    elif elementwise and not _state_value(key, value):
        problems.add(
            STATE,
            f"optimizer state {key!r} of parameter {pid} is a {type(value).__name__} "
            f"({_short(value)}),"
            f" not a {'number or one-element tensor' if key == 'step' else 'tensor'}",
        )
    elif (
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


def _number(value: Any) -> bool:
    return type(value) in (int, float)


def _value_kind(value: Any) -> Any:
    """What a hyperparameter or scheduler value is, for comparing a saved one with the live one:
    int and float (and a one-element tensor) are one kind, numbers; a bool is not a number; a
    sequence is its items' kinds."""
    if _number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return "number"
    if isinstance(value, (list, tuple)):
        return tuple(_value_kind(item) for item in value)
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


def _check_kind(saved: Any, live: Any, what: str, problems: _Problems) -> None:
    """A saved value must be of the live one's kind (None on either side is an option left unset)."""
    if saved is None or live is None or _value_kind(saved) == _value_kind(live):
        return
    problems.add(
        STATE,
        f"{what} is {_short(saved)} ({type(saved).__name__}), but the target holds {_short(live)} "
        f"({type(live).__name__}); a checkpoint of these objects holds a value of that kind",
    )


def _state_value(key: str, value: Any) -> bool:
    """Whether a built-in optimizer can take ``value`` as its per-parameter state ``key``."""
    if key == "step":  # a count: Adam and its kin call float() on it
        return _number(value) or (isinstance(value, torch.Tensor) and value.numel() == 1)
    # Tensors; None or numbers where older PyTorch kept them (SGD's momentum_buffer).
    return value is None or _number(value) or isinstance(value, torch.Tensor)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
    state: TrainState, section: Section | None, decoded: Callable[[Any], Any], problems: _Problems
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
    if section.class_name not in class_names(target):
        problems.add(STATE, f"the scheduler is a {section.class_name}, the target a {class_name(target)}")
        return None
    saved = decoded(section.state_dict)
    live = target.state_dict()
    if not _same_keys(saved, live, "scheduler", problems):
        return None
    # A scheduler's state has the shape its construction gave it: a SequentialLR of three
    # schedulers would take the states of two and keep its third as it was.
    for first, second in ((saved, live), (live, saved)):
        missing = next(
            (place for place, _, other in paired_leaves(first, second, "scheduler") if other is MISSING), None
        )
        if missing is not None:
            problems.add(
                STATE,
                f"the saved scheduler state and the target's differ in shape at {missing} (a "
                "scheduler built otherwise: another number of "
                "schedulers, milestones or param groups); create the scheduler as when saving",
            )
            return None
    for place, value, other in paired_leaves(saved, live, "scheduler"):
        _check_kind(value, other, f"the saved {place}", problems)
    return saved


def _check_scaler(
    state: TrainState, section: Section | None, decoded: Callable[[Any], Any], problems: _Problems
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
    saved = decoded(section.state_dict)
    # A disabled scaler's state is {}: both must be enabled, or both disabled.
    return saved if _same_keys(saved, target.state_dict(), "grad scaler", problems) else None


def _check_extras(
    state: TrainState,
    section: Mapping[str, Extra],
    decoded: Callable[[Any], Any],
    problems: _Problems,
    *,
    label: str = "extras",
    file: str = STATE,
) -> dict[str, Any]:
    live_extras = state.rank_extras if label == "rank_extras" else state.extras
    saved_names, live_names = set(section), set(live_extras)
    if saved_names != live_names:
        problems.add(
            file,
            f"{label} {sorted(saved_names - live_names)} saved but not in the target, "
            f"{sorted(live_names - saved_names)} in the target but not saved; "
            f"give the TrainState the same {label} names (any placeholder value) as when saving",
        )
        return {}
    out: dict[str, Any] = {}
    for name in sorted(section):
        entry, live = section[name], live_extras[name]
        stateful = is_stateful(live)
        if entry.stateful != stateful:
            problems.add(
                file,
                f"{label}[{name!r}] was saved as {entry.encode()['kind']}"
                f", the target is {'an object with state_dict' if stateful else 'a value'}",
            )
            continue
        value = decoded(entry.value)
        reference = live.state_dict() if stateful else live
        if (
            stateful
            and isinstance(reference, Mapping)
            and not _same_keys(value, reference, f"{label}[{name!r}]", problems)
        ):
            continue
        _match_tensors(
            value, reference, f"{label}[{name!r}]", problems, file=EXTRAS if file == STATE else file
        )
        out[name] = value
    return out


def _match_tensors(saved: Any, live: Any, path: str, problems: _Problems, *, file: str = EXTRAS) -> None:
    """Where the target holds a tensor, the saved value must be one of the same shape and dtype."""
    for place, target, value in paired_leaves(live, saved, root=path):
        if not isinstance(target, torch.Tensor) or value is MISSING:
            continue
        if not isinstance(value, torch.Tensor):
            problems.add(
                STATE if file == EXTRAS else file,
                f"{place} is a tensor in the target, a {type(value).__name__} in the checkpoint",
            )
        elif value.shape != target.shape or value.dtype != target.dtype:
            problems.add(
                file,
                f"{place} is {value.dtype} {list(value.shape)} saved, "
                f"{target.dtype} {list(target.shape)} in the target",
            )


def check_rng(dist: DistState, state: TrainState, content: Any, *, where: str) -> Generators:
    """Decode and check one rank's RNG file (parsed JSON): the states to set and this rank's
    decoded rank extras."""
    problems = _Problems(where)
    file = where.rsplit("/", 1)[-1]
    record = RngFile.decode(content, where=where)
    python, numpy_state, torch_state, cuda = (
        decode(value, tensors={}, where=where)
        for value in (record.python, record.numpy, record.torch, record.cuda)
    )
    if record.rank != dist.rank:
        problems.add(file, f"holds rank {record.rank!r}'s generators, this is rank {dist.rank}")
    trials: list[tuple[str, Callable[[], object]]] = [
        ("python", lambda: random.Random().setstate(python)),
        ("numpy", lambda: np.random.RandomState().set_state(numpy_state)),
        ("torch", lambda: torch.Generator().set_state(torch_state)),
    ]
    for name, trial in trials:
        try:  # a throwaway generator takes the state first: the live ones stay untouched
            trial()
        except Exception as error:  # any refusal means the state is unusable
            problems.add(file, f"the {name} generator state is invalid ({error})")
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
    for problem in record.malformed:
        problems.add(file, problem)
    extras = _check_extras(
        state,
        record.extras,
        lambda value: decode(value, tensors={}, where=where),
        problems,
        label="rank_extras",
        file=file,
    )
    problems.raise_if_any()
    stand_in = stand_ins(_objects(state))
    for name, value in extras.items():
        live = state.rank_extras[name]
        refused = load_problem(live, value, stand_in) if is_stateful(live) else None
        if refused is not None:
            problems.add(
                file,
                f"rank_extras[{name!r}]: the saved state does not load into the target's "
                f"{class_name(live)} ({refused})",
            )
    problems.raise_if_any()
    return Generators(python=python, numpy=numpy_state, torch=torch_state, cuda=cuda, extras=extras)
