"""``save_model``: a model's weights in the Hugging Face safetensors layout, committed as a whole.

One file, ``model.safetensors``, when the weights fit ``max_shard_size``;
otherwise shards and an index ``model.safetensors.index.json``
(``{"metadata": {"total_size": bytes}, "weight_map": {name: shard}}``); the
names are ``_naming``'s, loading is ``_load_model``.
Tied weights (two names, one tensor) are stored once, under the first name,
and a model with the same ties gets them back tied.

A sharded model (FSDP2, HSDP, tensor parallelism) is written by all its ranks,
each its own share of the tensors into its own shards (``_hf/_assign.py``,
``_hf/_spread_write.py``), never gathered whole on one rank.

A save commits as a whole, in one step: the shards of a sharded save carry
``TAG``, new for each save, so they never replace the shards of the save a
loader reads; the index, renamed in at once, switches to them. The single file
takes precedence over an index (as in ``transformers``): a one-file save
commits by its rename, a sharded save over a single file by deleting that file
after the index is in. Whatever the commit leaves behind (the other layout's
files, shards no index names, temporary files of a crashed or failed save) is
deleted after it, and at the start of the next save.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from faccel._checkpoint._folders import blocking_file
from faccel._checkpoint._strategies import StrategyState, strategy_of
from faccel._dist._consensus import DEFAULT_ARRIVAL, agree_max, arrive, together
from faccel._dist._state import DistState
from faccel._hf._assign import assign, rank_files
from faccel._hf._load_model import find_layout, read_weights
from faccel._hf._naming import (
    INDEX_NAME,
    METADATA,
    SHARD_FILE,
    TEMPORARY_FILE,
    WEIGHTS_NAME,
    parse_size,
    shard_names,
    split_shards,
)
from faccel._hf._spread_write import OwnFile, write_own
from faccel._loop._strategies import given_model, unwrap_model
from faccel._storage._durable import MAX_JSON, parse_json
from faccel._storage._roots import shown, spot_of
from faccel._storage._safetensors import TensorInfo, header_bytes, plan
from faccel._storage._store import Spot
from faccel._storage._weights import alias_groups, model_tensors
from faccel._typecheck import setup_checked
from faccel.errors import CheckpointError, StorageError

__all__ = ["convert_weights", "save_model"]


def _committed(directory: Spot) -> set[str] | None:
    """The weight files a loader reads in ``directory`` (load_model's precedence), or None if unknown.

    ``model.safetensors`` alone when it is there; else the index and the shards
    it names; none when neither is there. None (nothing may be deleted) when
    the index cannot be read as an index.
    """
    if (directory / WEIGHTS_NAME).size() is not None:
        return {WEIGHTS_NAME}
    index_path = directory / INDEX_NAME
    if index_path.size() is None:
        return set()
    try:
        buffer, _ = index_path.read(None, where=str(index_path), limit=MAX_JSON)
        weight_map = parse_json(buffer.numpy().tobytes(), str(index_path)).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return None
    return {INDEX_NAME, *weight_map.values()}


def _remove_leftovers(directory: Spot) -> None:
    """Delete what no loader reads: temporary files of our writes, and weight files the commit left.

    The other layout's files (an index beside ``model.safetensors``) and shards
    (``model-...-0000k-of-0000n.safetensors``) that the committed index does not
    name. Other files in ``directory`` are left alone.
    """
    committed = _committed(directory)
    stale = [
        name
        for name in (entry.name for entry in directory.entries() if not entry.folder)
        if TEMPORARY_FILE.fullmatch(name)
        or (
            committed is not None
            and (SHARD_FILE.fullmatch(name) or name == INDEX_NAME)
            and name not in committed
        )
    ]
    for name in stale:
        directory.store.delete((directory / name).key)
    if stale:
        directory.store.sync_folder(directory.key)


def _new_tag(directory: Spot) -> str:
    """8 hex digits that no shard in ``directory`` carries."""
    names = {entry.name for entry in directory.entries()}
    while True:
        tag = secrets.token_hex(4)
        if not any(name.startswith(f"model-{tag}-") for name in names):
            return tag


def _commit_index(directory: Spot, weight_map: Mapping[str, str], total_size: int) -> None:
    """The commit of a sharded save whose shards are in place (under new names, fsynced).

    The index switches to the new shards in one rename; over a single file
    (which a loader reads first), deleting that file commits.
    """
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    content = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
    directory.store.replace((directory / INDEX_NAME).key, [content])
    if (directory / WEIGHTS_NAME).size() is not None:
        directory.store.delete((directory / WEIGHTS_NAME).key)
        directory.store.sync_folder(directory.key)


def _write_model(
    directory: Spot,
    stored: Mapping[str, torch.Tensor],
    max_shard_size: int,
    extras: Mapping[str, bytes] | None = None,
    *,
    fetch: tuple[Mapping[str, int], Callable[[list[str]], Mapping[str, torch.Tensor]]] | None = None,
) -> None:
    """Write the weights, committed as a whole (see the module's docstring), then ``extras`` (name -> bytes).

    A failed write (an ``OSError``) deletes what it wrote before raising; the
    weights a loader reads are then those of the earlier save. ``fetch``: the
    tensors' sizes in bytes and how to get one shard's tensors when it is written
    (then ``stored`` is unused): one shard at a time in memory.
    """
    _prepare_folder(directory)
    sizes = {name: tensor.numel() * tensor.element_size() for name, tensor in stored.items()}

    def held(group: list[str]) -> Mapping[str, torch.Tensor]:
        return {key: stored[key] for key in group}

    get: Callable[[list[str]], Mapping[str, torch.Tensor]] = held
    if fetch is not None:
        sizes, get = dict(fetch[0]), fetch[1]
    groups = split_shards(sizes, max_shard_size)
    try:
        if len(groups) == 1:
            # One rename commits: model.safetensors takes precedence over any index.
            directory.store.replace((directory / WEIGHTS_NAME).key, plan(get(groups[0]), metadata=METADATA))
        else:
            names = shard_names(len(groups), tag=_new_tag(directory))
            for name, group in zip(names, groups, strict=True):
                # A new name: no loader reads it yet; it appears whole or not at all.
                with directory.store.publisher((directory / name).key) as out:
                    for chunk in plan(get(group), metadata=METADATA):
                        out.write(chunk)
                    out.close()
            directory.store.sync_folder(directory.key)
            weight_map = {key: name for name, group in zip(names, groups, strict=True) for key in group}
            _commit_index(directory, weight_map, sum(sizes.values()))
        for name, content in (extras or {}).items():
            directory.store.replace((directory / name).key, [content])
    except OSError:
        with contextlib.suppress(OSError):  # the write's error is the one to report
            _remove_leftovers(directory)
        raise
    _remove_leftovers(directory)  # the earlier save's files


@setup_checked
def save_model(
    dist: DistState,
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    arrival_timeout: datetime.timedelta = DEFAULT_ARRIVAL,
) -> Path | str:
    """Save the unwrapped model's weights to ``directory`` in the Hugging Face layout.

    ``model.safetensors``, or shards ``model-TAG-0000k-of-0000n.safetensors`` plus
    ``model.safetensors.index.json`` when the weights exceed ``max_shard_size``
    (``TAG``: 8 hex digits, new for each save). Tied weights are stored once
    (under their first name). Every process must call it (not under ``if
    dist.is_main_process:``); every process returns once the files are
    complete (a barrier), so all ranks may read them right after. The main
    process writes a replicated model. A sharded one (FSDP2, HSDP, tensor
    parallelism) is never whole on one rank: each rank gathers and writes only
    its share (balanced by bytes) into its own shards, at least one file per
    writing rank, and the main process commits the index; ``directory`` must
    then be a folder every rank sees (a shared file system).
    The save commits as a whole: a crash at any moment leaves the earlier
    save or this one for :func:`load_model` (and ``from_pretrained``), never a
    mix; the earlier save's files, and those of a crashed or failed save, are
    deleted after the commit (and a failed write deletes its own).
    A transformers model's ``config.json`` (and ``generation_config.json``
    where it has one) is written beside the weights, so ``from_pretrained``
    loads the folder as it is; other files in ``directory`` are left alone.

    Args:
        dist: The run's :class:`DistState`.
        model: The model, wrapped by :func:`prepare` or not.
        directory: Where to write; created if missing. A URL of object storage
            (``s3://bucket/model``) writes there (docs/object-storage.md); the result is then a URL.
        max_shard_size: Largest shard, in bytes or as text (``"5GB"``, ``"500MiB"``).
        arrival_timeout: How long the ranks that called ``save_model`` wait for
            the others to call it too, before raising.

    Returns:
        The directory.

    Raises:
        ArgumentValueError: A bad ``max_shard_size``.
        CheckpointError: A tensor dtype safetensors cannot hold, on the
            writing rank (every rank, for a sharded model). A rank did not
            call ``save_model`` within ``arrival_timeout``.
        StorageError: ``directory`` or a parent is a file; a failed write (an
            ``OSError``: a full disk, a permission) on a writing rank; on
            the other ranks, any failure of a writing rank; a sharded
            model's files that rank 0 does not see (a folder not shared).

    Example:
        >>> import tempfile, torch, faccel
        >>> folder = tempfile.mkdtemp()
        >>> faccel.save_model(faccel.detect({}), torch.nn.Linear(3, 2), folder).name == folder.split("/")[-1]
        True
        >>> import os; sorted(os.listdir(folder))
        ['model.safetensors']
    """
    target = spot_of(directory)
    limit = parse_size(max_shard_size)
    arrive(dist, "save_model", timeout=arrival_timeout, raises=CheckpointError)
    # A pipelined model's config is its whole model's (the one given to prepare), as for any model.
    whole = given_model(model)
    configs = {name: content.encode() for name, content in _configs(whole).items()}
    strategy = strategy_of(model)
    # Who writes: the main process; every rank its share (FSDP2, HSDP, tensor parallelism); or
    # the main process as all ranks gather tensor by tensor (DeepSpeed ZeRO-3).
    _EXPORTS[strategy.export_kind(model)](dist, strategy, model, target, limit, configs)
    return shown(target)


def _save_main(
    dist: DistState,
    strategy: StrategyState,
    model: Any,
    target: Spot,
    limit: int,
    configs: Mapping[str, bytes],
) -> None:
    """A model every rank holds whole: the main process writes it."""

    def write() -> None:
        if dist.is_main_process:
            stored, _ = model_tensors(unwrap_model(model))
            _write_model(target, stored, limit, configs)

    together(dist, write, what="save_model", raises=StorageError)


def _save_gathered(
    dist: DistState,
    strategy: StrategyState,
    engine: Any,
    target: Spot,
    limit: int,
    configs: Mapping[str, bytes],
) -> None:
    """DeepSpeed ZeRO-3: every rank gathers one shard's parameters at a time, one parameter at a time
    (each copied to the CPU of the main process, which writes the shard, then freed): at most one shard
    (``max_shard_size``) whole in memory."""
    specs, aliases = strategy.whole_specs(engine)
    sizes = {
        name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for name, (dtype, shape) in specs.items()
        if name not in aliases
    }
    groups = split_shards(sizes, limit)
    done: list[list[str]] = []

    def get(group: list[str]) -> Mapping[str, torch.Tensor]:
        done.append(group)
        return strategy.gather_named(engine, group, keep=dist.is_main_process)

    def write() -> None:
        if not dist.is_main_process:
            for group in groups:
                get(group)
            return
        try:
            _write_model(target, {}, limit, configs, fetch=(sizes, get))
        finally:  # a failed write still takes part in the other ranks' gathers, then raises
            for group in groups[len(done) :]:
                get(group)

    together(dist, write, what="save_model", raises=StorageError)


def _prepare_folder(directory: Spot) -> None:
    """The folder a save writes into: refused under a file, created, cleared of a crashed save's files."""
    blocked = blocking_file(directory)
    if blocked is not None:
        msg = (
            f"{blocked} is a file, not a folder: save_model writes model.safetensors (or its shards) "
            f"into the folder {directory}; pass the path of a folder (new or existing)"
        )
        raise StorageError(msg)
    directory.store.make_folder(directory.key)
    _remove_leftovers(directory)  # of a save that crashed


def _save_spread(
    dist: DistState,
    strategy: StrategyState,
    model: Any,
    target: Spot,
    limit: int,
    configs: Mapping[str, bytes],
) -> None:
    """A sharded model's save: each rank gathers and writes only its share; rank 0 commits.

    The plan (``_hf/_assign.py``: which rank writes which tensor, balanced by
    bytes, and into which file) is computed by every rank from the tensors'
    names, dtypes and global shapes, so it needs no communication. The files
    are numbered rank by rank (``model-TAG-0000k-of-0000n.safetensors``, one
    or more per writing rank); a plan of one file is ``model.safetensors``.
    Then, as a one-process save commits: the shards under names no index
    holds yet, and rank 0's index rename commits them all, after it has seen
    every rank's files (the folder must be shared by the ranks).
    """
    pieces = strategy.shard_state(model, None)
    state = dict(pieces[0]) if pieces is not None else strategy.target(model)
    names = list(state)
    aliases = alias_groups(state)
    # Ties are agreed on: a rank whose piece of a tied tensor is empty cannot see the tie.
    position = {name: index for index, name in enumerate(names)}
    firsts = agree_max(
        dist,
        [position[aliases[name]] if name in aliases else -1 for name in names],
        what="save_model's agreement on tied weights",
        raises=StorageError,
    )
    stored = [name for name, first in zip(names, firsts, strict=True) if first < 0]
    specs = {name: (state[name].dtype, tuple(state[name].shape)) for name in stored}  # global shapes
    sizes = {name: dtype.itemsize * int(torch.Size(shape).numel()) for name, (dtype, shape) in specs.items()}
    # Largest element size first, as plan() lays out a file: every tensor aligned to its element size.
    walk = sorted(stored, key=lambda name: -specs[name][0].itemsize)
    owner = assign(sizes, dist.world_size)
    # Where the strategy places a tensor itself (pipeline stages: the ranks of the stage that holds
    # it): those ranks share its stage's tensors, balanced by bytes.
    held = {name: lies for name in stored if (lies := strategy.held(state[name])) is not None}
    if held:
        blocks: dict[tuple[int, int], dict[str, int]] = {}
        for name in stored:
            blocks.setdefault((held[name].first, held[name].ranks), {})[name] = sizes[name]
        owner = {
            name: first + rank
            for (first, ranks), block in blocks.items()
            for name, rank in assign(block, ranks).items()
        }
    planned = rank_files(walk, sizes, owner, dist.world_size, limit)
    # Every rank builds every header: a dtype safetensors cannot hold is refused alike on all ranks.
    headers = [header_bytes(specs, list(file.names), METADATA) for file in planned]

    def prepare() -> int:
        if not dist.is_main_process:
            return 0
        _prepare_folder(target)
        return int(_new_tag(target), 16)

    (tag,) = agree_max(
        dist,
        [together(dist, prepare, what="save_model", raises=StorageError)],
        what="save_model",
        raises=StorageError,
    )
    files = shard_names(len(planned), tag=f"{tag:08x}")
    sizes_of = {
        file: len(header) + sum(sizes[name] for name in part.names)
        for file, header, part in zip(files, headers, planned, strict=True)
    }

    def write() -> None:
        # (On object storage a folder is a prefix: nothing to see until objects are in it.)
        if not target.store.folder_visible(target.key):
            msg = (
                f"save_model: rank {dist.rank} does not see the folder {target} that rank 0 created: "
                "a sharded model's save is written by every rank, into one folder all ranks share "
                "(a shared file system), as checkpoints are"
            )
            raise StorageError(msg)
        own = [
            OwnFile(name=file, header=header, names=part.names)
            for file, header, part in zip(files, headers, planned, strict=True)
            if part.rank == dist.rank
        ]
        write_own(state, walk, owner, dist.rank, target, own)

    def commit() -> None:
        if not dist.is_main_process:
            return
        for (file, size), part in zip(sizes_of.items(), planned, strict=True):
            found = (target / file).size()
            if found != size:
                msg = (
                    f"save_model: rank {part.rank} wrote {file} ({size} bytes), but rank 0 finds "
                    f"{'no such file' if found is None else f'{found} bytes'} in "
                    f"{target}: the folder must be one that every rank shares (a shared file system); "
                    "nothing was committed"
                )
                raise StorageError(msg)
        if len(files) > 1:
            pairs = zip(files, planned, strict=True)
            weight_map = {name: file for file, part in pairs for name in part.names}
            _commit_index(target, weight_map, sum(sizes.values()))
        # (one file: its owner's rename of model.safetensors committed it)
        for name, content in configs.items():
            target.store.replace((target / name).key, [content])
        _remove_leftovers(target)  # the earlier save's files

    try:
        together(dist, write, what="save_model", raises=StorageError)
        together(dist, commit, what="save_model", raises=StorageError)
    except Exception:
        if dist.is_main_process:
            with contextlib.suppress(OSError):  # the save's error is the one to report
                _remove_leftovers(target)
        raise


# Who writes each kind of export (the strategy says which kind, StrategyState.export_kind).
_EXPORTS: Mapping[str, Callable[[DistState, StrategyState, Any, Spot, int, Mapping[str, bytes]], None]] = {
    "main": _save_main,
    "spread": _save_spread,
    "gathered": _save_gathered,
}


def _configs(module: nn.Module) -> dict[str, str]:
    """What ``from_pretrained`` needs beside the weights, for a transformers model: file -> JSON.

    Found by what the model has, not by importing transformers: a ``config``
    and a ``generation_config`` that can write themselves as JSON.
    """
    files = {}
    for name, attribute in (("config.json", "config"), ("generation_config.json", "generation_config")):
        value = getattr(module, attribute, None)
        if value is not None and callable(getattr(value, "to_json_string", None)):
            files[name] = value.to_json_string()
    if "config.json" in files and hasattr(module.config, "architectures"):
        # As save_pretrained records it (on a copy: the model's own config is not changed).
        content = json.loads(files["config.json"])
        content["architectures"] = [type(module).__name__]
        files["config.json"] = json.dumps(content, indent=2, sort_keys=True) + "\n"
    return files


def convert_weights(
    source: str | os.PathLike[str], target: str | os.PathLike[str], *, max_shard_size: int | str = "5GB"
) -> Path | str:
    """Rewrite the weights in ``source`` (``pytorch_model.bin`` or its shards) to safetensors in ``target``.

    ``python -m faccel convert SOURCE TARGET``. The tensors are read as
    :func:`load_model` reads them (``.bin`` through the restricted loader),
    tied weights are stored once, and ``config.json`` and
    ``generation_config.json`` are copied when ``source`` has them. Either
    may be a URL of object storage (``s3://bucket/model``, docs/object-storage.md).

    Returns:
        ``target``: a :class:`~pathlib.Path`, or the URL.

    Raises:
        CheckpointError: As :func:`load_model`: no weights, a file that holds
            anything but tensors, an inconsistent index.
        StorageError: ``target`` is a file; the writing failed (a full disk,
            a permission), with nothing of it kept.
        ArgumentValueError: ``source`` or ``target`` is not a valid root (a mistyped URL).

    Example:
        >>> import pathlib, tempfile, torch
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
        >>> sorted(p.name for p in convert_weights(folder, folder / "out").iterdir())
        ['model.safetensors']
    """
    folder, out = spot_of(source), spot_of(target)
    found, within = find_layout(folder)
    by_file: dict[str, dict[str, TensorInfo]] = {}
    for name, (file, entry) in found.items():
        if not isinstance(entry, torch.Tensor):
            by_file.setdefault(file, {})[name] = entry
    read = {file: read_weights(folder / file, infos, within) for file, infos in by_file.items()}
    tensors = {
        name: entry if isinstance(entry, torch.Tensor) else read[file][name]
        for name, (file, entry) in found.items()
    }
    aliases = alias_groups(tensors)
    stored = {name: tensor.contiguous() for name, tensor in tensors.items() if name not in aliases}
    # Read as the weights are: regular files, no link out of the folder; written with the commit.
    names = {entry.name for entry in folder.entries()}
    configs: dict[str, bytes] = {
        name: folder.store.read(
            (folder / name).key, None, where=str(folder / name), limit=MAX_JSON, within=within
        )[0]
        .numpy()
        .tobytes()
        for name in ("config.json", "generation_config.json")
        if name in names
    }
    try:
        _write_model(out, stored, parse_size(max_shard_size), configs)
    except OSError as error:  # a full disk, a permission: _write_model removed what it wrote
        msg = (
            f"converting into {out} failed: {error.strerror or error} ({error.filename or out}); free "
            "space or correct the path or permissions, then run it again (nothing of this run was kept)"
        )
        raise StorageError(msg) from error
    return shown(out)
