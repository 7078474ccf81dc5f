"""``load_model``: weights in the Hugging Face layout (or the legacy ``.bin``) into a model, checked first.

Either layout is read (the single file, or the index and its shards; names in ``_naming``),
safetensors by byte ranges and ``.bin`` through torch's restricted loader, from a local folder or
a URL of object storage alike: every file is an open ``Reader`` of the storage seam (``pread`` on
the disk, ranged GETs on an object store), each read bounded by the size the store reports. Every header is
read and every name, shape and dtype compared with the model's before any weight is copied; a
sharded model's DTensors take only their own rows (``_shard_read``), and the model's strategy
loads the rest (``_checkpoint/_strategies``: ZeRO into its partitions).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from faccel._checkpoint._format import shard_name
from faccel._checkpoint._strategies import Ownership, strategy_of
from faccel._dist._dtensor import copy_box
from faccel._dist._state import DistState
from faccel._hf._naming import INDEX_NAME, WEIGHTS_NAME
from faccel._hf._shard_read import load_rows
from faccel._storage._durable import MAX_JSON, parse_json
from faccel._storage._roots import spot_of
from faccel._storage._safetensors import TensorInfo, read_header, read_tensors
from faccel._storage._store import Spot
from faccel._storage._torch_bin import BIN_INDEX_NAME, BIN_NAME, read_bin
from faccel._storage._weights import compare_tensors
from faccel._torch_compat import is_dtensor
from faccel._typecheck import setup_checked
from faccel.errors import CheckpointError

__all__ = ["find_layout", "load_model", "read_weights"]

_Reader = Callable[[Spot, Sequence[Path]], Mapping[str, Any]]


def _json(file: Spot, within: Sequence[Path]) -> Any:
    """An index, read as the weights are (links as ``within`` allows), capped at ``MAX_JSON``."""
    buffer, _ = file.store.read(file.key, None, where=str(file), limit=MAX_JSON, within=within)
    return parse_json(buffer.numpy().data, str(file))


def _from_index(index_path: Spot, read: _Reader, within: Sequence[Path]) -> dict[str, tuple[str, Any]]:
    """``name -> (shard, entry)`` for every tensor of a sharded layout, checked against its index.

    ``read`` gives a shard's entries: safetensors headers, or the tensors of ``.bin`` shards.
    Every shard is read and checked before this returns (nothing is loaded into a model yet).
    """
    index = _json(index_path, within)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str)
        and isinstance(v, str)
        and "/" not in v
        and "\x00" not in v
        and v not in ("", ".", "..")
        for k, v in weight_map.items()
    ):
        # (A NUL byte in a name would reach the OS as torch's raw "embedded null byte".)
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


def _header(path: Spot, within: Sequence[Path]) -> dict[str, TensorInfo]:
    return dict(read_header(path, where=str(path), within=within).tensors)


def _bin(path: Spot, within: Sequence[Path]) -> dict[str, torch.Tensor]:
    """A ``.bin`` file's tensors: memory-mapped on the disk, read whole from object storage."""
    return read_bin(path, within)


# The layouts load_model reads, in order of preference: (single file, index, reader of a file).
# safetensors is read by byte ranges; the legacy .bin through torch's restricted loader.
_LAYOUTS: tuple[tuple[str, str, _Reader], ...] = (
    (WEIGHTS_NAME, INDEX_NAME, _header),
    (BIN_NAME, BIN_INDEX_NAME, _bin),
)


def _roots(directory: Spot) -> tuple[Path, ...]:
    """The folders load_model follows symbolic links into: ``directory`` itself (its real path)
    and, for a Hugging Face cache snapshot (``.../snapshots/<revision>``, whose files are links
    to ``../../blobs/<hash>``), that cache's ``blobs`` folder. (A store without links: its key.)"""
    store = directory.store
    real = store.resolve(directory.key)
    revisions = store.parent(real)
    blobs = store.join(store.parent(revisions), "blobs")
    snapshot = Spot(store, revisions).name == "snapshots" and store.is_folder(blobs)
    return (Path(real), Path(blobs)) if snapshot else (Path(real),)


def _names(directory: Spot) -> Callable[[str], bool]:
    """Whether a name is in ``directory``, by one listing (a FIFO, a folder or a link in a file's
    place is a name too: the reader refuses it, it is not skipped)."""
    names = {entry.name for entry in directory.entries()}
    return names.__contains__


def find_layout(
    directory: str | os.PathLike[str] | Spot,
) -> tuple[dict[str, tuple[str, Any]], tuple[Path, ...]]:
    """Every stored tensor: ``name -> (file, TensorInfo or tensor)``, from a single file or an index;
    and the folders its files may link into (see :func:`_roots`). ``directory``: a path, or a URL
    (or :class:`Spot`) of object storage, whose objects are read by ranged GETs."""
    directory = spot_of(directory)
    within = _roots(directory)
    there = _names(directory)
    for single, index, read in _LAYOUTS:
        if there(single):
            return {name: (single, entry) for name, entry in read(directory / single, within).items()}, within
        if there(index):
            return _from_index(directory / index, read, within), within
    msg = (
        f"{directory}: neither {WEIGHTS_NAME} nor {INDEX_NAME} is there (nor the legacy {BIN_NAME} or "
        f"{BIN_INDEX_NAME}); pass the folder that faccel.save_model (or save_pretrained) wrote"
    )
    if there(shard_name(0)):  # a sharded checkpoint (version 2)
        msg = (
            f"{directory}: a sharded checkpoint (each rank's shard-RANK.safetensors): its weights are "
            "not one model.safetensors; write them in the Hugging Face layout with "
            f"python -m faccel consolidate {directory} OUT, then load OUT"
        )
    raise CheckpointError(msg)


def _spec(entry: Any) -> tuple[torch.dtype, tuple[int, ...]]:
    return entry.dtype, tuple(entry.shape)


def _stage_names(
    ownership: Ownership, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]], *, strict: bool
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], list[str]]:
    """The file's names this rank compares and loads, and what is wrong with the others.

    A rank that holds every name takes every name. A pipeline stage's rank takes its stages'
    names; the names of the model's other stages are theirs (neither read nor unexpected here),
    and, when ``strict``, every rank checks that the file holds each of them.
    """
    if ownership.every_name:
        return specs, []
    model_names = ownership.model_names or frozenset()
    mine = {name: spec for name, spec in specs.items() if ownership.owns(name) or name not in model_names}
    problems = []
    if strict:
        problems = [
            f"missing {name!r} (another pipeline stage's)"
            for name in sorted(model_names - set(specs))
            if not ownership.owns(name)
        ]
    return mine, problems


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
        directory: The folder holding the weights: a path, or a URL of object
            storage (``s3://bucket/model``: each tensor's bytes read by ranged GETs).
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
    folder = spot_of(directory)
    layout, within = find_layout(folder)
    strategy = strategy_of(model)
    target = strategy.target(model)
    specs = {name: _spec(entry) for name, (_, entry) in layout.items()}
    # The strategy names the ties (ZeRO-3's stand-ins have no memory to tell them by).
    for later, first in strategy.whole_specs(model)[1].items():
        if later not in specs and first in specs:
            specs[later] = specs[first]
    # Pipeline stages: this rank takes its stages' names only; another stage's are not unexpected.
    specs, elsewhere = _stage_names(strategy.ownership(model), specs, strict=strict)
    missing, unexpected, problems = compare_tensors(specs, target, strict=strict)
    problems += elsewhere
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
                tensors = read_weights(folder / file, {name: layout[name][1] for name in names}, within)
            # ZeRO: into its partitions and fp32 masters too (a collective under ZeRO-3).
            strategy.load_weights(model, tensors)
    return tuple(missing), tuple(unexpected)


def read_weights(
    path: Path | Spot, infos: Mapping[str, TensorInfo], within: Sequence[Path]
) -> dict[str, torch.Tensor]:
    return read_tensors(path, infos, where=str(path), within=within)
