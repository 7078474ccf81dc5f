"""``state.json`` and each rank's ``rng-RANK.json`` as typed records, with one encode and one
decode each: their keys are spelled here only.

``state.json`` holds a checkpoint's counters (step, epoch, position, the data consumed, where the
run resumed), the world size that wrote it, the model's tensor names (and tied aliases), and the
state of the optimizer, scheduler, grad scaler and extras as tagged JSON (``_storage/_tagged_json``;
their tensors live in the safetensors files). The sharded format adds ``tensors``, the index of
every tensor's chunks (``_sharded._chunks.parse_index`` checks it).

:func:`~faccel._checkpoint._capture.capture` builds a :class:`StateFile`, ``_save`` writes
:meth:`StateFile.encode`; ``restore`` reads it back with :meth:`StateFile.decode`, which checks
the record's shape (every section present and of its type, every counter an int >= 0) and names
what is wrong in one :class:`CheckpointError`. What depends on the objects restored into (a
class, a key set, a tensor's shape) is ``_verify``'s. The bytes written are those of every
earlier faccel: ``consumed`` and ``resumed_at`` may be absent (checkpoints from before them).

``rng-RANK.json`` (:class:`RngFile`) holds one rank's generator states (Python, NumPy, torch and,
on CUDA, every device's) as tagged JSON, and its rank extras; ``_verify.check_rng`` decodes the
states into :class:`Generators`, and a rank the checkpoint has no file of gets a :class:`NewRank`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from faccel._checkpoint._format import RNG_FORMAT, STATE_FORMAT
from faccel.errors import CheckpointError

__all__ = ["Extra", "Generators", "NewRank", "RngFile", "Section", "StateFile", "decode_extras"]


@attrs.frozen(kw_only=True)
class Section:
    """One object's saved state: its class (``module.QualName``; None for the grad scaler, whose
    class is not recorded) and its ``state_dict`` as tagged JSON.

    Example:
        >>> Section(class_name="torch.optim.sgd.SGD", state_dict={"state": {}}).encode()
        {'class': 'torch.optim.sgd.SGD', 'state_dict': {'state': {}}}
    """

    state_dict: Any
    class_name: str | None = None

    def encode(self) -> dict[str, Any]:
        """The section's JSON object (``class`` first, when recorded)."""
        head = {} if self.class_name is None else {"class": self.class_name}
        return {**head, "state_dict": self.state_dict}


@attrs.frozen(kw_only=True)
class Extra:
    """One extra as saved: through its ``state_dict`` (``stateful``) or as a value, as tagged JSON.

    Example:
        >>> Extra(stateful=False, value=3).encode()
        {'kind': 'value', 'value': 3}
    """

    stateful: bool
    value: Any

    def encode(self) -> dict[str, Any]:
        """The extra's JSON object."""
        return {"kind": "stateful" if self.stateful else "value", "value": self.value}


@attrs.frozen(kw_only=True)
class StateFile:
    """What ``state.json`` says.

    ``model_keys`` are the model's state-dict names in order; ``model_aliases`` maps a tied name to
    the name whose tensor is stored. ``tensors`` is the sharded format's index (None in the
    whole-tensor format), kept as written.

    Example:
        >>> state = StateFile(
        ...     step=3, epoch=0, position=2, world_size=1, model_keys=("w",), model_aliases={},
        ...     optimizer=None, scheduler=None, scaler=None, extras={"seen": Extra(stateful=False, value=5)},
        ... )
        >>> StateFile.decode(state.encode(), where="state.json") == state
        True
        >>> StateFile.decode({**state.encode(), "step": -1}, where="state.json")
        Traceback (most recent call last):
            ...
        faccel.errors.CheckpointError: state.json: step must be an int >= 0, got -1
    """

    step: int
    epoch: int
    position: int
    world_size: int
    model_keys: tuple[str, ...]
    model_aliases: Mapping[str, str]
    optimizer: Section | None
    scheduler: Section | None
    scaler: Section | None
    extras: Mapping[str, Extra]
    # Positions of the epoch's order all ranks had read (None: saved without TrainState.loader, or
    # before faccel recorded it), and TrainState.resumed_at.
    consumed: int | None = None
    resumed_at: tuple[int, int] | None = None
    tensors: Any = None

    def encode(self) -> dict[str, Any]:
        """The JSON object of ``state.json``, its keys in the order every faccel wrote them."""
        encoded = {
            "format": STATE_FORMAT,
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,
            "consumed": self.consumed,
            "resumed_at": None if self.resumed_at is None else list(self.resumed_at),
            "world_size": self.world_size,
            "model": {"keys": list(self.model_keys), "aliases": dict(self.model_aliases)},
            "optimizer": None if self.optimizer is None else self.optimizer.encode(),
            "scheduler": None if self.scheduler is None else self.scheduler.encode(),
            "scaler": None if self.scaler is None else self.scaler.encode(),
            "extras": {name: extra.encode() for name, extra in self.extras.items()},
        }
        if self.tensors is not None:
            encoded["tensors"] = self.tensors
        return encoded

    @classmethod
    def decode(cls, raw: Any, *, where: str) -> StateFile:
        """A parsed ``state.json`` checked to be one faccel wrote, or one :class:`CheckpointError`
        naming ``where`` and every key that is missing or of the wrong type."""
        if not isinstance(raw, dict) or raw.get("format") != STATE_FORMAT:
            msg = f"{where}: not a faccel checkpoint state (format should be {STATE_FORMAT!r})"
            raise CheckpointError(msg)
        problems: list[str] = []
        step, epoch, position = (_counter(raw, key, problems) for key in ("step", "epoch", "position"))
        world = raw.get("world_size")
        if type(world) is not int or world < 1:
            problems.append(f"world_size must be an int >= 1, got {world!r}")
            world = 1
        consumed = raw.get("consumed")
        if consumed is not None and (type(consumed) is not int or consumed < 0):
            problems.append(f"consumed must be null or an int >= 0, got {consumed!r}")
        at = raw.get("resumed_at")
        if at is not None and not (
            isinstance(at, list) and len(at) == 2 and all(type(v) is int and v >= 0 for v in at)
        ):
            problems.append(f"resumed_at must be null or [epoch, consumed] of ints >= 0, got {at!r}")
            at = None
        keys, aliases = _model(raw.get("model"), problems)
        optimizer = _section(raw, "optimizer", problems, named=True)
        scheduler = _section(raw, "scheduler", problems, named=True)
        scaler = _section(raw, "scaler", problems, named=False)
        extras, malformed = decode_extras(raw.get("extras"), label="extras")
        problems += malformed
        if problems:
            raise CheckpointError(f"{where}: " + "; ".join(problems))
        return cls(
            step=step,
            epoch=epoch,
            position=position,
            world_size=world,
            model_keys=keys,
            model_aliases=aliases,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            extras=extras,
            consumed=consumed,
            resumed_at=None if at is None else (at[0], at[1]),
            tensors=raw.get("tensors"),
        )


def _counter(raw: Mapping[str, Any], key: str, problems: list[str]) -> int:
    value = raw.get(key)
    if type(value) is not int or value < 0:
        problems.append(f"{key} must be an int >= 0, got {value!r}")
        return 0
    return value


def _model(section: Any, problems: list[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    keys = section.get("keys") if isinstance(section, dict) else None
    aliases = section.get("aliases") if isinstance(section, dict) else None
    if (
        not isinstance(keys, list)
        or not isinstance(aliases, dict)
        or not all(isinstance(k, str) for k in keys)
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items())
    ):
        problems.append("model needs keys (a list of names) and aliases (names to names)")
        return (), {}
    return tuple(keys), dict(aliases)


def _section(raw: Mapping[str, Any], key: str, problems: list[str], *, named: bool) -> Section | None:
    if key not in raw:
        problems.append(f"{key} is missing (null when none was saved)")
        return None
    section = raw[key]
    if section is None:
        return None
    name = section.get("class") if isinstance(section, dict) else None
    if not isinstance(section, dict) or "state_dict" not in section or (named and not isinstance(name, str)):
        what = "a class (a string) and a state_dict" if named else "a state_dict"
        problems.append(f"{key} must be null or an object with {what}")
        return None
    return Section(state_dict=section["state_dict"], class_name=name if named else None)


def decode_extras(section: Any, *, label: str) -> tuple[dict[str, Extra], list[str]]:
    """The extras of a parsed ``extras`` object (``state.json``'s, or a generator file's rank
    extras), and what is wrong with it (empty when nothing is).

    Example:
        >>> decode_extras({"seen": {"kind": "value", "value": 3}}, label="extras")
        ({'seen': Extra(stateful=False, value=3)}, [])
        >>> decode_extras([], label="rank_extras")
        ({}, ['rank_extras must be a JSON object'])
    """
    if not isinstance(section, dict):
        return {}, [f"{label} must be a JSON object"]
    extras, problems = {}, []
    for name, entry in section.items():
        kind = entry.get("kind") if isinstance(entry, dict) else None
        if kind not in ("stateful", "value") or "value" not in entry:
            problems.append(
                f"{label}[{name!r}] must be an object with a kind (stateful or value) and a value"
            )
            continue
        extras[name] = Extra(stateful=kind == "stateful", value=entry["value"])
    return extras, problems


@attrs.frozen(kw_only=True)
class RngFile:
    """What one rank's ``rng-RANK.json`` says: the rank, its generators' states and its rank
    extras, all as tagged JSON (decoded and checked by ``_verify.check_rng``).

    Example:
        >>> rng = RngFile(rank=0, python=[3], numpy={}, torch=None, cuda=None, extras={})
        >>> RngFile.decode(rng.encode(), where="rng-00000.json") == rng
        True
        >>> RngFile.decode({"format": "other"}, where="rng-00000.json")
        Traceback (most recent call last):
        ...
        faccel.errors.CheckpointError: rng-00000.json: not a faccel RNG state ...'faccel.checkpoint.rng')
    """

    rank: Any
    python: Any
    numpy: Any
    torch: Any
    cuda: Any
    extras: Mapping[str, Extra]
    malformed: tuple[str, ...] = ()  # what is wrong with the extras (checked with the rest)

    def encode(self) -> dict[str, Any]:
        """The file's JSON object."""
        return {
            "format": RNG_FORMAT,
            "rank": self.rank,
            "python": self.python,
            "numpy": self.numpy,
            "torch": self.torch,
            "cuda": self.cuda,
            "extras": {name: extra.encode() for name, extra in self.extras.items()},
        }

    @classmethod
    def decode(cls, raw: Any, *, where: str) -> RngFile:
        """The record of a parsed file; not faccel's is a :class:`CheckpointError` (checkpoints from
        before rank extras have none)."""
        if not isinstance(raw, dict) or raw.get("format") != RNG_FORMAT:
            msg = f"{where}: not a faccel RNG state (format should be {RNG_FORMAT!r})"
            raise CheckpointError(msg)
        extras, malformed = decode_extras(raw.get("extras", {}), label="rank_extras")
        return cls(
            rank=raw.get("rank"),
            python=raw.get("python"),
            numpy=raw.get("numpy"),
            torch=raw.get("torch"),
            cuda=raw.get("cuda"),
            extras=extras,
            malformed=tuple(malformed),
        )


@attrs.frozen(kw_only=True)
class Generators:
    """One rank's generator states, decoded and checked, and its rank extras' decoded values."""

    python: Any
    numpy: Any
    torch: Any
    cuda: Any
    extras: Mapping[str, Any]


@attrs.frozen(kw_only=True)
class NewRank:
    """A rank the checkpoint has no generators of (restored at a larger world size): its
    generators are seeded from ``(seed, step, rank)``."""

    seed: int
    rank: int
