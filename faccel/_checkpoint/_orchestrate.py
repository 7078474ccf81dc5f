"""``checkpoint`` and ``restore``: a TrainState to a folder of safetensors and JSON, atomically.

The flow across ranks; the layout is in ``_format`` (and docs/checkpoints.md).
The commit is one ``rename`` of a fully written and fsynced temporary folder,
so a crash at any moment leaves the earlier checkpoints whole and the partial
one invisible (restore only reads ``step-*`` folders). Under DDP every rank
calls ``checkpoint``; rank 0 writes everything but the other ranks' RNG files,
and the ranks meet three times (prepare, write, commit). All ranks must see
one shared file system. ``restore`` checks everything (``_verify``) before
anything is loaded (``_load``).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from faccel._checkpoint._capture import capture, capture_rng
from faccel._checkpoint._durable import FileRecord, fsync_dir, in_parallel, read_verified, write_durably
from faccel._checkpoint._folders import latest_checkpoint, manifest_step, remove_leftovers, rotate
from faccel._checkpoint._format import (
    EXTRAS,
    FORMAT,
    MANIFEST,
    MODEL,
    MODEL_METADATA,
    OPTIMIZER,
    STATE,
    VERSION,
    checkpoint_name,
    expected_files,
    rng_name,
    temporary_name,
    trash_name,
)
from faccel._checkpoint._load import load
from faccel._checkpoint._safetensors import parse_header, plan, tensor_views
from faccel._checkpoint._sharded_state import full_state
from faccel._checkpoint._verify import Loadable, check, check_manifest, check_rng
from faccel._consensus import agree_max, together
from faccel._model import is_sharded, unwrap_model
from faccel._state import DistState
from faccel._train_state import TrainState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError, CheckpointError

__all__ = ["checkpoint", "latest_checkpoint", "restore"]


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _parse_json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        msg = f"{where}: not valid JSON ({str(error)[:120]})"
        raise CheckpointError(msg) from None


def _write_rank0(
    temporary: Path, content: dict[str, Any], files: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, FileRecord]:
    def write(name: str) -> Callable[[], FileRecord]:
        metadata = MODEL_METADATA if name == MODEL else None
        return lambda: write_durably(temporary / name, plan(files[name], metadata=metadata))

    # Side by side: one file's fsync overlaps the next one's writing and hashing.
    names = [MODEL, OPTIMIZER, EXTRAS]
    records = dict(zip(names, in_parallel([write(name) for name in names]), strict=True))
    records[STATE] = write_durably(temporary / STATE, [_json_bytes(content)])
    return records


def _commit(
    dist: DistState,
    root: Path,
    temporary: Path,
    final: Path,
    records: dict[str, FileRecord],
    content: dict[str, Any],
    keep: int | None,
) -> None:
    for rank in range(dist.world_size):
        name = rng_name(rank)
        if name not in records:  # written by another rank on the shared file system
            records[name] = read_verified(temporary / name, None, where=str(temporary / name))[1]
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": content["step"],
        "epoch": content["epoch"],
        "position": content["position"],
        "world_size": dist.world_size,
        "torch_version": torch.__version__,
        "files": {
            name: {"size": records[name].size, "sha256": records[name].sha256}
            for name in expected_files(dist.world_size)
        },
    }
    write_durably(temporary / MANIFEST, [_json_bytes(manifest)])
    fsync_dir(temporary)
    trash = None
    if final.exists():
        # The same step again: move the old one aside, then the new one in. Between the
        # two renames only older checkpoints are visible (documented).
        trash = root / trash_name(final.name)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(temporary, final)
    fsync_dir(root)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
    if keep is not None:
        rotate(root, keep, content["step"])


@setup_checked
def checkpoint(
    dist: DistState,
    train_state: TrainState,
    path: str | os.PathLike[str],
    *,
    keep: int | None = None,
) -> Path:
    """Save ``train_state`` as ``path/step-NNNNNNNNNNNN``, atomically and durably, without pickle.

    Tensors go to safetensors, everything else (optimizer param groups,
    scheduler and scaler state, step, epoch, position, each rank's random
    generators, extras) to JSON, and a manifest lists every file with its
    size and SHA-256. The checkpoint is written into a temporary sibling
    folder, every file and the folder are fsynced, and one rename makes it
    visible: a crash at any moment leaves the earlier checkpoints whole, and
    the partial one invisible to :func:`restore`.

    Under DDP call it on every rank: rank 0 writes the model, optimizer and
    state, every rank writes its own random-generator file, and every rank
    returns once the checkpoint is committed. The folder must be on a file
    system that all ranks share. Training must not change the tensors while
    this call runs (it reads them in place, without copies).

    Args:
        dist: The run's :class:`DistState`.
        train_state: What to save.
        path: The root folder of the run's checkpoints (created if missing).
        keep: Keep only this many checkpoints, the new one included, deleting
            the oldest (folders with a higher step than this one are never
            deleted). None keeps all.

    Returns:
        The new checkpoint's folder.

    Raises:
        ArgumentValueError: ``keep`` < 1, or a simulated DistState of several ranks.
        CheckpointError: A value with no pickle-free form in the state (the
            message names it), or a failed write on any rank; earlier
            checkpoints are untouched.

    Example:
        >>> import tempfile, torch, faccel
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = faccel.TrainState.create(model=model, optimizer=optimizer)
        >>> root = tempfile.mkdtemp()
        >>> faccel.checkpoint(faccel.detect({}), state, root).name
        'step-000000000000'
    """
    if keep is not None and keep < 1:
        msg = f"keep must be at least 1 (the new checkpoint), or None to keep all; got {keep!r}"
        raise ArgumentValueError(msg)
    if dist.world_size > 1 and not dist.distributed:
        msg = (
            f"a simulated DistState of {dist.world_size} ranks has no peers to write their "
            "generator files; checkpoint from a real run (faccel.detect under a launcher), "
            "or with a one-process DistState"
        )
        raise ArgumentValueError(msg)
    root = Path(path)
    step = train_state.step
    final = root / checkpoint_name(step)
    temporary = root / temporary_name(step)
    rng = capture_rng(dist)
    low, high = agree_max(dist, [-step, step])
    if -low != high:
        msg = f"the ranks are checkpointing different steps ({-low} to {high}); pass the same TrainState.step"
        raise CheckpointError(msg)

    model = unwrap_model(train_state.model)
    # FSDP2: every rank takes part in gathering whole tensors onto rank 0, which then
    # writes them exactly as an unsharded model's (so any world size can restore them).
    whole = full_state(model, train_state.optimizer) if is_sharded(model) else None

    def prepare() -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]]] | None:
        if not dist.is_main_process:
            return None
        captured = capture(dist, train_state, whole)  # refuses unstorable values before any file exists
        root.mkdir(parents=True, exist_ok=True)
        remove_leftovers(root)
        temporary.mkdir()
        return captured

    captured = together(dist, prepare, what="preparing the checkpoint folder", raises=CheckpointError)

    def write() -> dict[str, FileRecord]:
        records = {rng_name(dist.rank): write_durably(temporary / rng_name(dist.rank), [_json_bytes(rng)])}
        if captured is not None:
            records |= _write_rank0(temporary, *captured)
        return records

    records = together(dist, write, what="writing the checkpoint", raises=CheckpointError)

    def commit() -> None:
        if captured is not None:
            _commit(dist, root, temporary, final, records, captured[0], keep)

    together(dist, commit, what="committing the checkpoint", raises=CheckpointError)
    return final


def _resolve(path: Path) -> Path:
    directory = latest_checkpoint(path)
    if directory is None:
        msg = (
            f"{path}: no checkpoint there: neither a checkpoint folder (it has no valid {MANIFEST}) "
            f"nor a folder of complete checkpoints (step-NNNNNNNNNNNN/{MANIFEST})"
        )
        raise CheckpointError(msg)
    return directory


def _read_manifest(directory: Path, dist: DistState, model: nn.Module) -> tuple[dict[str, FileRecord], int]:
    where = f"{directory}/{MANIFEST}"
    buffer, _ = read_verified(directory / MANIFEST, None, where=where)
    manifest = _parse_json(buffer.numpy().tobytes(), where)
    return check_manifest(manifest, dist, model, where=where)


def _read_checkpoint(
    dist: DistState, state: TrainState, directory: Path
) -> tuple[Loadable, dict[str, Any] | None]:
    records, world = _read_manifest(directory, dist, state.model)
    # A rank beyond the writers' (resharding to more ranks) has no generators saved.
    rng_file = rng_name(dist.rank) if dist.rank < world else None

    def read(name: str) -> Callable[[], torch.Tensor]:
        return lambda: read_verified(directory / name, records[name], where=f"{directory}/{name}")[0]

    # Files are read and hashed side by side: hashing, not the disk, bounds a restore.
    names = [MODEL, OPTIMIZER, EXTRAS, STATE] + ([rng_file] if rng_file else [])
    buffers = dict(zip(names, in_parallel([read(name) for name in names]), strict=True))
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name in (MODEL, OPTIMIZER, EXTRAS):
        header = parse_header(buffers[name].numpy().data, records[name].size, where=f"{directory}/{name}")
        tensors[name] = tensor_views(buffers[name], header)
    state_where = f"{directory}/{STATE}"
    content = _parse_json(buffers[STATE].numpy().tobytes(), state_where)
    rng_where = f"{directory}/{rng_file}"
    rng_content = _parse_json(buffers[rng_file].numpy().tobytes(), rng_where) if rng_file else None
    try:
        loadable = check(dist, state, content, tensors, where=str(directory))
        rng = check_rng(dist, rng_content, where=rng_where) if rng_file else None
    except RecursionError:
        msg = f"{directory}: a JSON file nests too deeply to be a faccel checkpoint"
        raise CheckpointError(msg) from None
    return loadable, rng


@setup_checked
def restore(dist: DistState, train_state: TrainState, path: str | os.PathLike[str]) -> TrainState:
    """Load a checkpoint into ``train_state``'s objects and return the saved TrainState.

    ``path`` is one checkpoint folder, or a root folder of them (then the
    latest complete one, see :func:`latest_checkpoint`). Everything is checked
    before any object is touched: the manifest's format and version, every
    file's presence, size and SHA-256, and the saved keys, shapes, dtypes and
    classes against the model, optimizer, scheduler, scaler and extras given.
    Then the model, optimizer, scheduler and scaler are loaded in place,
    objects among the extras through ``load_state_dict``, and this rank's
    Python, NumPy, torch (and CUDA) random generators are set as they were.

    Resume the data where it stopped with
    ``loader.at(epoch=state.epoch, start=state.position)``: the batches an
    uninterrupted run would have read next, without reading the skipped ones.

    Args:
        dist: The run's :class:`DistState`: the world size of the writer under
            DDP; any world size for one process or an FSDP2 model (resharding).
        train_state: The objects to load into, built as when saving; its
            extras name the entries to restore (any placeholder value; where
            it holds a tensor, the saved one must match its shape and dtype).
        path: A checkpoint folder, or a root folder of checkpoints.

    Returns:
        A new TrainState: the same objects, with the saved step, epoch,
        position and extras.

    Raises:
        CheckpointError: No checkpoint at ``path``, or one that is corrupted,
            truncated, foreign, of another version or world size, or does not
            fit the objects; the message names the file and the problem, and
            nothing has been modified.

    Example:
        >>> import tempfile, attrs, torch, faccel
        >>> dist, root = faccel.detect({}), tempfile.mkdtemp()
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = faccel.TrainState.create(model=model, optimizer=optimizer)
        >>> _ = faccel.checkpoint(dist, attrs.evolve(state, step=7, position=3), root)
        >>> fresh = torch.nn.Linear(2, 1)
        >>> restored = faccel.restore(dist, faccel.TrainState.create(
        ...     model=fresh, optimizer=torch.optim.SGD(fresh.parameters(), lr=0.1)), root)
        >>> (restored.step, restored.position, torch.equal(fresh.weight, model.weight))
        (7, 3, True)
    """
    directory = together(
        dist, lambda: _resolve(Path(path)), what="finding the checkpoint", raises=CheckpointError
    )
    step = manifest_step(directory) or 0
    low, high = agree_max(dist, [-step, step])
    if -low != high:
        msg = (
            f"{path}: the ranks found different latest checkpoints (steps {-low} to {high}); "
            "all ranks must see one shared file system"
        )
        raise CheckpointError(msg)
    loadable, rng = together(
        dist,
        lambda: _read_checkpoint(dist, train_state, directory),
        what="checking the checkpoint",
        raises=CheckpointError,
    )
    return load(train_state, loadable, rng)
