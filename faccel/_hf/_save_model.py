"""``save_model`` and ``load_model``: a model's weights in the Hugging Face safetensors layout.

One file, ``model.safetensors``, when the weights fit ``max_shard_size``;
otherwise shards ``model-TAG-00001-of-0000N.safetensors`` and an index
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes},
"weight_map": {name: shard}}``), every file with the metadata
``{"format": "pt"}``. That is what ``transformers`` and ``huggingface_hub``
write and read (they read the shards the index names, whatever their names).
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
import re
import secrets
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from faccel._checkpoint._folders import blocking_file
from faccel._checkpoint._format import MODEL, MODEL_METADATA, shard_name
from faccel._checkpoint._sharded._fsdp_state import sharded_state
from faccel._dist._consensus import DEFAULT_ARRIVAL, agree_max, arrive, together
from faccel._dist._dtensor import copy_box
from faccel._dist._state import DistState
from faccel._hf._assign import assign, rank_files
from faccel._hf._shard_read import load_rows
from faccel._hf._spread_write import OwnFile, write_own
from faccel._loop._deepspeed import is_deepspeed_engine
from faccel._loop._model import is_sharded, unwrap_model
from faccel._loop._zero_state import (
    gather_named,
    has_partitioned_parameters,
    load_full_state,
    target_state,
    whole_specs,
)
from faccel._storage._durable import (
    MAX_JSON,
    atomic_write,
    fsync_dir,
    read_json,
    read_verified,
    write_durably,
)
from faccel._storage._safetensors import TensorInfo, header_bytes, plan, read_header, read_tensors
from faccel._storage._torch_bin import BIN_INDEX_NAME, BIN_NAME, load_bin
from faccel._storage._weights import alias_groups, compare_tensors, model_tensors
from faccel._torch_compat import is_dtensor
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError, CheckpointError, StorageError

__all__ = [
    "INDEX_NAME",
    "WEIGHTS_NAME",
    "load_model",
    "parse_size",
    "save_model",
    "shard_names",
    "split_shards",
]

# The single-file name and metadata are the checkpoint's model file's too (one definition, in _format).
WEIGHTS_NAME = MODEL
INDEX_NAME = "model.safetensors.index.json"
_METADATA = MODEL_METADATA
# The shards a save writes (tagged) or another tool wrote (untagged): those no committed index names go.
_SHARD = re.compile(r"model(-[0-9a-f]{8})?-\d{5}-of-\d{5}\.safetensors")
# Temporary files of save_model's writes (atomic_write's ".tmp-" siblings), left by a crash or a failure.
_TEMPORARY = re.compile(r"\.tmp-(model.*\.safetensors(\.index\.json)?|config\.json|generation_config\.json)")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or text like ``"5GB"`` (10^9) or ``"500MiB"`` (2^20).

    Example:
        >>> parse_size("5GB"), parse_size("2KiB"), parse_size(100)
        (5000000000, 2048, 100)
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*", size, flags=re.IGNORECASE)
        if match is None:
            msg = f"max_shard_size must be bytes (int) or text like '5GB' or '500MiB', got {size!r}"
            raise ArgumentValueError(msg)
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        msg = f"max_shard_size must be at least 1 byte, got {size!r}"
        raise ArgumentValueError(msg)
    return value


def split_shards(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most ``max_shard_size`` bytes.

    Greedy, as ``huggingface_hub`` does it: a tensor that does not fit the
    current shard starts the next; a tensor larger than the limit gets a shard
    of its own.

    Example:
        >>> split_shards({"a": 6, "b": 6, "c": 2, "d": 1}, 8)
        [['a'], ['b', 'c'], ['d']]
    """
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if current and used + size > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int, tag: str | None = None) -> list[str]:
    """File names of ``count`` shards, as Hugging Face names them, with ``tag`` when given.

    :func:`save_model` tags the shards of each sharded save (8 hex digits, new
    for each save) so that they never replace the shards the committed index
    names; any name listed in the index's ``weight_map`` is valid for
    ``transformers`` and ``huggingface_hub``.

    Example:
        >>> shard_names(1), shard_names(2)
        (['model.safetensors'], ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
        >>> shard_names(2, tag="0a1b2c3d")[0]
        'model-0a1b2c3d-00001-of-00002.safetensors'
    """
    if count == 1:
        return [WEIGHTS_NAME]
    prefix = "model" if tag is None else f"model-{tag}"
    return [f"{prefix}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]


def _committed(directory: Path) -> set[str] | None:
    """The weight files a loader reads in ``directory`` (load_model's precedence), or None if unknown.

    ``model.safetensors`` alone when it is there; else the index and the shards
    it names; none when neither is there. None (nothing may be deleted) when
    the index cannot be read as an index.
    """
    if (directory / WEIGHTS_NAME).is_file():
        return {WEIGHTS_NAME}
    index_path = directory / INDEX_NAME
    if not index_path.is_file():
        return set()
    try:
        weight_map = json.loads(index_path.read_bytes()).get("weight_map")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        return None
    return {INDEX_NAME, *weight_map.values()}


def _remove_leftovers(directory: Path) -> None:
    """Delete what no loader reads: temporary files of our writes, and weight files the commit left.

    The other layout's files (an index beside ``model.safetensors``) and shards
    (``model-...-0000k-of-0000n.safetensors``) that the committed index does not
    name. Other files in ``directory`` are left alone.
    """
    committed = _committed(directory)
    stale = [
        name
        for name in os.listdir(directory)
        if _TEMPORARY.fullmatch(name)
        or (
            committed is not None and (_SHARD.fullmatch(name) or name == INDEX_NAME) and name not in committed
        )
    ]
    for name in stale:
        (directory / name).unlink(missing_ok=True)
    if stale:
        fsync_dir(directory)


def _new_tag(directory: Path) -> str:
    """8 hex digits that no shard in ``directory`` carries."""
    present = set(os.listdir(directory))
    while True:
        tag = secrets.token_hex(4)
        if not any(name.startswith(f"model-{tag}-") for name in present):
            return tag


def _commit_index(directory: Path, weight_map: Mapping[str, str], total_size: int) -> None:
    """The commit of a sharded save whose shards are in place (under new names, fsynced).

    The index switches to the new shards in one rename; over a single file
    (which a loader reads first), deleting that file commits.
    """
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    content = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
    atomic_write(directory / INDEX_NAME, [content])
    if (directory / WEIGHTS_NAME).is_file():
        (directory / WEIGHTS_NAME).unlink()
        fsync_dir(directory)


def _write_model(
    directory: Path,
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
            atomic_write(directory / WEIGHTS_NAME, plan(get(groups[0]), metadata=_METADATA))
        else:
            names = shard_names(len(groups), tag=_new_tag(directory))
            for name, group in zip(names, groups, strict=True):
                temporary = directory / f".tmp-{name}"
                write_durably(temporary, plan(get(group), metadata=_METADATA))
                os.replace(temporary, directory / name)  # a new name: no loader reads it yet
            fsync_dir(directory)
            weight_map = {key: name for name, group in zip(names, groups, strict=True) for key in group}
            _commit_index(directory, weight_map, sum(sizes.values()))
        for name, content in (extras or {}).items():
            atomic_write(directory / name, [content])
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
) -> Path:
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
        directory: Where to write; created if missing.
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
    target = Path(directory)
    limit = parse_size(max_shard_size)
    arrive(dist, "save_model", timeout=arrival_timeout, raises=CheckpointError)
    inner = unwrap_model(model)
    configs = {name: content.encode() for name, content in _configs(inner).items()}
    if is_sharded(inner):  # FSDP2, HSDP, tensor parallelism: every rank writes its share
        _save_spread(dist, inner, target, limit, configs)
        return target
    if has_partitioned_parameters(model):  # DeepSpeed ZeRO-3: gathered tensor by tensor
        _save_gathered(dist, model, target, limit, configs)
        return target

    def write() -> None:
        if dist.is_main_process:
            stored, _ = model_tensors(inner)
            _write_model(target, stored, limit, configs)

    together(dist, write, what="save_model", raises=StorageError)
    return target


def _save_gathered(
    dist: DistState, engine: Any, target: Path, limit: int, configs: Mapping[str, bytes]
) -> None:
    """DeepSpeed ZeRO-3: every rank gathers one shard's parameters at a time, one parameter at a time
    (each copied to the CPU of the main process, which writes the shard, then freed): at most one shard
    (``max_shard_size``) whole in memory."""
    specs, aliases = whole_specs(engine)
    sizes = {
        name: math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for name, (dtype, shape) in specs.items()
        if name not in aliases
    }
    groups = split_shards(sizes, limit)
    done: list[list[str]] = []

    def get(group: list[str]) -> Mapping[str, torch.Tensor]:
        done.append(group)
        return gather_named(engine, group, keep=dist.is_main_process)

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


def _prepare_folder(directory: Path) -> None:
    """The folder a save writes into: refused under a file, created, cleared of a crashed save's files."""
    blocked = blocking_file(directory)
    if blocked is not None:
        msg = (
            f"{blocked} is a file, not a folder: save_model writes model.safetensors (or its shards) "
            f"into the folder {directory}; pass the path of a folder (new or existing)"
        )
        raise StorageError(msg)
    directory.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(directory)  # of a save that crashed


def _save_spread(
    dist: DistState, module: nn.Module, target: Path, limit: int, configs: Mapping[str, bytes]
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
    state = sharded_state(module, None)[0]
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
    planned = rank_files(walk, sizes, owner, dist.world_size, limit)
    # Every rank builds every header: a dtype safetensors cannot hold is refused alike on all ranks.
    headers = [header_bytes(specs, list(file.names), _METADATA) for file in planned]

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
        if not target.is_dir():
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
            path = target / file
            if not path.is_file() or path.stat().st_size != size:
                msg = (
                    f"save_model: rank {part.rank} wrote {file} ({size} bytes), but rank 0 finds "
                    f"{'no such file' if not path.is_file() else f'{path.stat().st_size} bytes'} in "
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
            atomic_write(target / name, [content])
        _remove_leftovers(target)  # the earlier save's files

    try:
        together(dist, write, what="save_model", raises=StorageError)
        together(dist, commit, what="save_model", raises=StorageError)
    except Exception:
        if dist.is_main_process:
            with contextlib.suppress(OSError):  # the save's error is the one to report
                _remove_leftovers(target)
        raise


_Reader = Callable[[Path, Sequence[Path]], Mapping[str, Any]]


def _from_index(index_path: Path, read: _Reader, within: Sequence[Path]) -> dict[str, tuple[str, Any]]:
    """``name -> (shard, entry)`` for every tensor of a sharded layout, checked against its index.

    ``read`` gives a shard's entries: safetensors headers, or the tensors of ``.bin`` shards.
    Every shard is read and checked before this returns (nothing is loaded into a model yet).
    """
    index = read_json(index_path, where=str(index_path), within=within)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str)
        and isinstance(v, str)
        and "/" not in v
        and "\x00" not in v
        and v not in ("", ".", "..")
        for k, v in weight_map.items()
    ):
        # (A NUL byte in a name would reach the OS as torch's raw "embedded null byte": issue 35, item 8.)
        msg = (
            f"{index_path}: needs a weight_map of tensor names to shard file names in the folder "
            "(plain names: no '/', no NUL byte)"
        )
        raise CheckpointError(msg)
    layout: dict[str, tuple[str, Any]] = {}
    problems: list[str] = []
    for shard in sorted(set(weight_map.values())):
        for name, entry in read(index_path.parent / shard, within).items():
            if weight_map.get(name) != shard:
                problems.append(f"{shard} holds {name!r}, which the index maps to {weight_map.get(name)!r}")
            else:
                layout[name] = (shard, entry)
    problems += [
        f"{name!r} is in the index but not in {shard}"
        for name, shard in weight_map.items()
        if name not in layout
    ]
    if problems:
        msg = f"{index_path}: the index and the shards disagree: " + "; ".join(problems)
        raise CheckpointError(msg)
    return layout


def _header(path: Path, within: Sequence[Path]) -> dict[str, TensorInfo]:
    return dict(read_header(path, where=str(path), within=within).tensors)


# The layouts load_model reads, in order of preference: (single file, index, reader of a file).
# safetensors is read by byte ranges; the legacy .bin through torch's restricted loader.
_LAYOUTS: tuple[tuple[str, str, _Reader], ...] = (
    (WEIGHTS_NAME, INDEX_NAME, _header),
    (BIN_NAME, BIN_INDEX_NAME, load_bin),
)


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


def _roots(directory: Path) -> tuple[Path, ...]:
    """The folders load_model follows symbolic links into: ``directory`` itself (its real path)
    and, for a Hugging Face cache snapshot (``.../snapshots/<revision>``, whose files are links
    to ``../../blobs/<hash>``), that cache's ``blobs`` folder."""
    real = Path(os.path.realpath(directory))
    blobs = real.parent.parent / "blobs"
    return (real, blobs) if real.parent.name == "snapshots" and blobs.is_dir() else (real,)


def _layout(directory: Path) -> tuple[dict[str, tuple[str, Any]], tuple[Path, ...]]:
    """Every stored tensor: ``name -> (file, TensorInfo or tensor)``, from a single file or an index;
    and the folders its files may link into (see :func:`_roots`)."""
    within = _roots(directory)
    for single, index, read in _LAYOUTS:
        # lexists: a FIFO, a folder or a link in a file's place is refused by the reader, not skipped.
        if os.path.lexists(directory / single):
            return {name: (single, entry) for name, entry in read(directory / single, within).items()}, within
        if os.path.lexists(directory / index):
            return _from_index(directory / index, read, within), within
    msg = (
        f"{directory}: neither {WEIGHTS_NAME} nor {INDEX_NAME} is there (nor the legacy {BIN_NAME} or "
        f"{BIN_INDEX_NAME}); pass the folder that faccel.save_model (or save_pretrained) wrote"
    )
    if os.path.lexists(directory / shard_name(0)):  # a sharded checkpoint (version 2)
        msg = (
            f"{directory}: a sharded checkpoint (each rank's shard-RANK.safetensors): its weights are "
            "not one model.safetensors; write them in the Hugging Face layout with "
            f"python -m faccel consolidate {directory} OUT, then load OUT"
        )
    raise CheckpointError(msg)


def _spec(entry: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    return entry.dtype, tuple(entry.shape)


@setup_checked
def load_model(
    dist: DistState,
    model: nn.Module,
    directory: str | os.PathLike[str],
    *,
    strict: bool = True,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Load weights saved by :func:`save_model` (or Hugging Face) into ``model``, in place.

    Reads either layout: ``model.safetensors``, or the index and its shards.
    Everything is checked before any weight is copied: every file's header
    (every shard's, when sharded), missing and unexpected names (when
    ``strict``), shape and dtype mismatches (always) are all listed in one
    :class:`CheckpointError`, and the model is left untouched. Only the
    tensors the model takes are read. Files are read only when they are
    regular files; a symbolic link is followed only into ``directory`` itself
    (or, in a Hugging Face cache snapshot, into the cache's ``blobs``). A name
    the file lacks is not missing when the model ties it to a name the file
    has. Every rank reads the files (they must be visible to all ranks).

    Args:
        dist: The run's :class:`DistState`.
        model: The model, wrapped by :func:`prepare` or not.
        directory: The folder holding the weights.
        strict: Refuse missing and unexpected names.

    Returns:
        ``(missing, unexpected)`` names (both empty when ``strict``).

    Raises:
        CheckpointError: No weights in ``directory``, an inconsistent index,
            a malformed file (or one that is not a regular file, or a link
            out of ``directory``), or a mismatch with the model.

    Example:
        >>> import tempfile, torch, faccel
        >>> dist, folder = faccel.detect({}), tempfile.mkdtemp()
        >>> _ = faccel.save_model(dist, torch.nn.Linear(3, 2), folder)
        >>> faccel.load_model(dist, torch.nn.Linear(3, 2), folder)
        ((), ())
        >>> faccel.load_model(dist, torch.nn.Linear(4, 2), folder)
        Traceback (most recent call last):
        ...
        faccel.errors.CheckpointError: ...'weight' has shape [2, 3] in the file, [2, 4] in the model
    """
    folder = Path(directory)
    layout, within = _layout(folder)
    inner = unwrap_model(model)
    deepspeed = is_deepspeed_engine(model)
    target = target_state(model) if deepspeed else inner.state_dict()
    specs = {name: _spec(entry) for name, (_, entry) in layout.items()}
    if deepspeed:  # ZeRO-3's stand-ins have no memory to tell ties by: the engine names them
        for later, first in whole_specs(model)[1].items():
            if later not in specs and first in specs:
                specs[later] = specs[first]
    missing, unexpected, problems = compare_tensors(specs, target, strict=strict)
    if problems:
        msg = f"{folder}: the weights do not fit the model: " + "; ".join(problems)
        raise CheckpointError(msg)
    wanted = set(target)
    by_file: dict[str, list[str]] = {}
    for name, (file, _) in layout.items():
        if name in wanted:
            by_file.setdefault(file, []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            # A sharded model's DTensors: each rank reads (or keeps) its own rows only (_shard_read).
            shards = {name: (layout[name][1], target[name]) for name in names if is_dtensor(target[name])}
            names = [name for name in names if name not in shards]
            if isinstance(layout[next(iter(shards), names[0] if names else "")][1], torch.Tensor):
                for entry, live in shards.values():  # .bin: read whole, then kept by rows
                    copy_box(entry, live)
            elif shards:
                load_rows(folder / file, shards, within=within)
            if not names:
                continue
            if isinstance(layout[names[0]][1], torch.Tensor):  # .bin: the entries are the tensors
                tensors = {name: layout[name][1] for name in names}
            else:  # safetensors: the entries say where to read
                tensors = _read_tensors(folder / file, {name: layout[name][1] for name in names}, within)
            if deepspeed:  # into ZeRO's partitions and fp32 masters too (a collective under ZeRO-3)
                load_full_state(model, None, tensors, None)
            else:
                inner.load_state_dict(tensors, strict=False)
    return tuple(missing), tuple(unexpected)


def _read_tensors(
    path: Path, infos: Mapping[str, TensorInfo], within: Sequence[Path]
) -> dict[str, torch.Tensor]:
    return read_tensors(path, infos, where=str(path), within=within)


def convert_weights(
    source: str | os.PathLike[str], target: str | os.PathLike[str], *, max_shard_size: int | str = "5GB"
) -> Path:
    """Rewrite the weights in ``source`` (``pytorch_model.bin`` or its shards) to safetensors in ``target``.

    ``python -m faccel convert SOURCE TARGET``. The tensors are read as
    :func:`load_model` reads them (``.bin`` through the restricted loader),
    tied weights are stored once, and ``config.json`` and
    ``generation_config.json`` are copied when ``source`` has them.

    Raises:
        CheckpointError: As :func:`load_model`: no weights, a file that holds
            anything but tensors, an inconsistent index.
        StorageError: ``target`` is a file; the writing failed (a full disk,
            a permission), with nothing of it kept.

    Example:
        >>> import pathlib, tempfile, torch
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> torch.save({"w": torch.ones(2)}, folder / "pytorch_model.bin")
        >>> sorted(p.name for p in convert_weights(folder, folder / "out").iterdir())
        ['model.safetensors']
    """
    folder, out = Path(source), Path(target)
    layout, within = _layout(folder)
    by_file: dict[str, dict[str, TensorInfo]] = {}
    for name, (file, entry) in layout.items():
        if not isinstance(entry, torch.Tensor):
            by_file.setdefault(file, {})[name] = entry
    read = {file: _read_tensors(folder / file, infos, within) for file, infos in by_file.items()}
    tensors = {
        name: entry if isinstance(entry, torch.Tensor) else read[file][name]
        for name, (file, entry) in layout.items()
    }
    aliases = alias_groups(tensors)
    stored = {name: tensor.contiguous() for name, tensor in tensors.items() if name not in aliases}
    # Read as the weights are: regular files, no link out of the folder; written with the commit.
    configs = {
        name: read_verified(folder / name, None, where=str(folder / name), limit=MAX_JSON, within=within)[0]
        .numpy()
        .tobytes()
        for name in ("config.json", "generation_config.json")
        if os.path.lexists(folder / name)
    }
    try:
        _write_model(out, stored, parse_size(max_shard_size), configs)
    except OSError as error:  # a full disk, a permission: _write_model removed what it wrote
        msg = (
            f"converting into {out} failed: {error.strerror or error} ({error.filename or out}); free "
            "space or correct the path or permissions, then run it again (nothing of this run was kept)"
        )
        raise StorageError(msg) from error
    return out
