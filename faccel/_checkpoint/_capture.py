"""Live objects to what a checkpoint writes: ``state.json``'s content, tensors, generators.

:func:`capture` turns a TrainState into ``state.json``'s content and the
tensors of three safetensors files, without copying a tensor.
:func:`capture_rng` turns this process's random generators (Python, NumPy,
torch, CUDA) into its ``rng-NNNNN.json`` content. :func:`class_name` and
:func:`is_stateful` decide what the content says of an object; verification
and loading ask them the same of the target objects.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from faccel._checkpoint._format import EXTRAS, MODEL, OPTIMIZER
from faccel._checkpoint._state_file import Extra, RngFile, Section, StateFile
from faccel._dist._state import DistState
from faccel._loop._strategies import unwrap_model
from faccel._storage._tagged_json import TensorSink, encode
from faccel._storage._weights import model_tensors
from faccel._train_state import TrainState, global_position

__all__ = ["capture", "capture_rng", "class_name", "class_names", "extras_digests", "is_stateful"]


def class_name(obj: object) -> str:
    """The ``module.QualName`` of ``obj``'s class, as ``state.json`` records it.

    Example:
        >>> class_name(1.0)
        'builtins.float'
    """
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def class_names(obj: object) -> frozenset[str]:
    """Every name ``state.json`` may hold for ``obj``'s class: :func:`class_name` and the former ones.

    A faccel class that moved between modules lists the names its checkpoints recorded
    before the move in a ``formerly`` tuple, so restore still accepts those checkpoints.

    Example:
        >>> sorted(class_names(1.0))
        ['builtins.float']
    """
    kind = type(obj)
    formerly = vars(kind).get("formerly", ()) if kind.__module__.startswith("faccel.") else ()
    return frozenset((class_name(obj), *formerly))


def is_stateful(value: object) -> bool:
    """Whether ``value`` is saved through ``state_dict`` and loaded through ``load_state_dict``.

    Example:
        >>> import torch
        >>> is_stateful(torch.nn.Linear(1, 1)), is_stateful({"seen": 3})
        (True, False)
    """
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def capture(
    dist: DistState,
    state: TrainState,
    whole: tuple[Mapping[str, Any], Mapping[str, Any] | None] | None = None,
    *,
    shards: bool = False,
) -> tuple[StateFile, dict[str, dict[str, torch.Tensor]]]:
    """``state.json``'s record (:class:`StateFile`) and each safetensors file's tensors, for ``state``.

    Tensors are the live ones (no copy): write them before training goes on.
    ``whole``: an FSDP2 model's gathered model and optimizer state dicts, which
    are stored exactly as an unsharded model's would be; with ``shards``, its
    sharded ones (DTensors), for the sharded format.
    """
    model_state = None if whole is None else whole[0]
    optimizer_state: Any = whole[1] if whole is not None else None
    if whole is None and state.optimizer is not None:
        optimizer_state = state.optimizer.state_dict()
    stored, aliases = model_tensors(unwrap_model(state.model), model_state, shards=shards)
    optimizer_sink = TensorSink(file=OPTIMIZER, shards=shards)
    extras_sink = TensorSink(file=EXTRAS)
    scheduler = state.scheduler
    scaler = state.scaler
    extras = _encode_extras(state.extras, extras_sink, "extras")
    content = StateFile(
        step=state.step,
        epoch=state.epoch,
        position=state.position,
        consumed=global_position(state),
        resumed_at=state.resumed_at,
        world_size=dist.world_size,
        model_keys=tuple(unwrap_model(state.model).state_dict() if model_state is None else model_state),
        model_aliases=aliases,
        optimizer=None
        if state.optimizer is None
        else Section(
            class_name=class_name(state.optimizer),
            state_dict=encode(optimizer_state, sink=optimizer_sink),
        ),
        scheduler=None
        if scheduler is None
        else Section(
            class_name=class_name(scheduler),
            state_dict=encode(scheduler.state_dict(), sink=extras_sink, path="scheduler"),
        ),
        scaler=None
        if scaler is None
        else Section(state_dict=encode(scaler.state_dict(), sink=extras_sink, path="scaler")),
        extras=extras,
    )
    files = {MODEL: stored, OPTIMIZER: optimizer_sink.tensors, EXTRAS: extras_sink.tensors}
    return content, files


def _encode_extras(extras: Mapping[str, Any], sink: TensorSink | None, label: str) -> dict[str, Extra]:
    encoded = {}
    for name, value in extras.items():
        stateful = is_stateful(value)
        tree = encode(value.state_dict() if stateful else value, sink=sink, path=f"{label}.{name}")
        encoded[name] = Extra(stateful=stateful, value=tree)
    return encoded


def extras_digests(extras: Mapping[str, Any]) -> dict[str, int]:
    """A 62-bit digest of each extra's saved form (its JSON and every tensor's bytes).

    Equal extras on two ranks give equal digests; an extra with no pickle-free
    form gets -1 (``capture`` names it).
    """
    digests = {}
    for name in sorted(extras):
        sink = TensorSink(file=EXTRAS)
        try:
            encoded = _encode_extras({name: extras[name]}, sink, "extras")
        except Exception:  # refused by encode; capture raises the named error
            digests[name] = -1
            continue
        h = hashlib.sha256(json.dumps({k: e.encode() for k, e in encoded.items()}, sort_keys=True).encode())
        for key, tensor in sorted(sink.tensors.items()):
            h.update(key.encode())
            h.update(str((tensor.dtype, tuple(tensor.shape))).encode())
            h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        digests[name] = int.from_bytes(h.digest()[:8], "little") >> 2
    return digests


def capture_rng(dist: DistState, rank_extras: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This process's random generators and rank extras as tagged JSON (tensors inline, base64)."""
    cuda = torch.cuda.get_rng_state_all() if dist.device.type == "cuda" else None
    return RngFile(
        rank=dist.rank,
        python=encode(random.getstate()),
        numpy=encode(np.random.get_state(legacy=False)),
        torch=encode(torch.get_rng_state()),
        cuda=None if cuda is None else encode(cuda),
        extras=_encode_extras(rank_extras or {}, None, "rank_extras"),
    ).encode()
