"""``restore``: a checkpoint folder back into live objects, everything checked before anything is loaded.

``restore`` finds the latest whole checkpoint (``_folders``; a damaged one is
passed over with a warning), checks everything (``_verify``) before anything is
loaded (``_load``). At another world size a position inside an epoch becomes a
global one (``_check_world_change``), and what cannot be carried over exactly
is refused (a position saved without its loader, rank extras). The forward
flow is ``_save``.
"""

from __future__ import annotations

import datetime
import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import attrs
import torch
from torch import nn

from faccel._checkpoint._background import wait as wait_for_background
from faccel._checkpoint._folders import (
    FolderManifest,
    counted,
    latest_checkpoint,
    read_folder_manifest,
    scan,
)
from faccel._checkpoint._format import (
    EXTRAS,
    MANIFEST,
    MODEL,
    OPTIMIZER,
    STATE,
    VERSION_SHARDED,
    WHOLE_VERSIONS,
    rng_name,
)
from faccel._checkpoint._history import Rollback, check_restore_choice, refuse_later, set_aside
from faccel._checkpoint._load import load
from faccel._checkpoint._sharded._flow import (
    read_tensors,
)
from faccel._checkpoint._state_file import Generators, NewRank, StateFile
from faccel._checkpoint._strays import stray_names
from faccel._checkpoint._verify import Loadable, check, check_manifest, check_rng, model_target
from faccel._dist._consensus import DEFAULT_ARRIVAL, agree_max, arrive, together
from faccel._dist._process_group import breadcrumb
from faccel._dist._state import DistState
from faccel._storage._durable import MAX_JSON, FileRecord, allocatable_bytes, in_parallel, parse_json
from faccel._storage._roots import spot_of
from faccel._storage._safetensors import parse_header, tensor_views
from faccel._storage._store import Spot
from faccel._train_state import TrainState
from faccel._typecheck import setup_checked
from faccel.errors import CheckpointError, CheckpointWarning

__all__ = ["latest_checkpoint", "restore"]


class _BrokenError(CheckpointError):
    """A checkpoint's files fail their check (missing, truncated, altered): ``restore(root)`` passes it over.

    Not a mismatch with the objects given, which no older checkpoint would cure.
    """


def _read_manifest(
    directory: Spot | Path, dist: DistState, model: nn.Module, manifest: FolderManifest | None = None
) -> tuple[dict[str, FileRecord], int, int]:
    """The checked records of ``directory``'s manifest (``manifest``: already read, not read again)."""
    folder = spot_of(directory)
    found = manifest if manifest is not None else read_folder_manifest(folder)
    where = str(folder / MANIFEST)
    if found.step is None:
        raise _BrokenError(found.why or f"{where}: the file is missing")
    if found.manifest is None:  # a step, but refused by Manifest.decode: named, never passed over
        raise CheckpointError(found.refused or f"{where}: not a faccel checkpoint manifest")
    return check_manifest(found.manifest, dist, model, where=where)


def _read_checkpoint(
    dist: DistState, state: TrainState, manifest: FolderManifest
) -> tuple[Loadable, Generators | NewRank]:
    directory = manifest.folder
    records, world, version = _read_manifest(directory, dist, state.model, manifest)
    # A rank beyond the writers' (resharding to more ranks) has no generators saved.
    rng_file = rng_name(dist.rank) if dist.rank < world else None

    caps = _whole_file_caps(state) if version in WHOLE_VERSIONS else {}

    def read(name: str, record: FileRecord | None = None) -> Callable[[], torch.Tensor]:
        limit = MAX_JSON if name.endswith(".json") else caps.get(name)
        # Never more than this process can allocate (a forged size, a sparse file): refused by name
        # before read_verified's buffer, as the sharded format does (issue 35, item 8).
        room = allocatable_bytes()
        limit = room if limit is None else limit if room is None else min(limit, room)
        where = f"{directory}/{name}"
        return lambda: (directory / name).read(record or records[name], where=where, limit=limit)[0]

    # Files are read and hashed side by side, each hashed on a thread of its own as it is read.
    whole = [MODEL, OPTIMIZER] if version in WHOLE_VERSIONS else []
    names = [*whole, EXTRAS, STATE]
    try:
        buffers = dict(zip(names, in_parallel([read(name) for name in names]), strict=True))
    except CheckpointError as error:
        raise _BrokenError(str(error)) from None
    tensors: dict[str, dict[str, torch.Tensor]] = {}
    for name in (*whole, EXTRAS):
        header = parse_header(buffers[name].numpy().data, records[name].size, where=f"{directory}/{name}")
        tensors[name] = tensor_views(buffers[name], header)
    state_where = f"{directory}/{STATE}"
    content = StateFile.decode(parse_json(buffers[STATE].numpy().tobytes(), state_where), where=state_where)
    try:
        if version == VERSION_SHARDED:
            # Only the rows this rank's target holds, from the shard files that hold them.
            shards, pages = read_tensors(directory, records, world, state, content, where=str(directory))
            tensors |= shards
            rng_record = pages.of(dist.rank)[1] if rng_file else None
        else:
            rng_record = records[rng_file] if rng_file else None
        rng_buffer = read(rng_file, rng_record)() if rng_file else None
    except CheckpointError as error:
        raise _BrokenError(str(error)) from None
    rng_where = f"{directory}/{rng_file}"
    rng_content = parse_json(rng_buffer.numpy().tobytes(), rng_where) if rng_buffer is not None else None
    try:
        loadable = check(dist, state, content, tensors, where=str(directory))
        # A rank beyond the writers' gets generators seeded from (seed, step, rank): see _load.
        rng: Generators | NewRank = (
            check_rng(dist, state, rng_content, where=rng_where)
            if rng_file
            else NewRank(seed=dist.seed, rank=dist.rank)
        )
    except RecursionError:
        msg = f"{directory}: a JSON file nests too deeply to be a faccel checkpoint"
        raise CheckpointError(msg) from None
    if world != dist.world_size:
        loadable = _check_world_change(directory, world, dist.world_size, loadable, state)
    return loadable, rng


# A safetensors header may hold up to 100 MB; a file is that, its tensors, and alignment padding.
_HEADER_ROOM = 100_000_000 + (1 << 20)
# Optimizer state per parameter byte: Adam's two moments (three with amsgrad) in up to twice the width.
_OPTIMIZER_PER_PARAMETER_BYTE = 8


def _whole_file_caps(state: TrainState) -> dict[str, int]:
    """The most bytes a whole-tensor ``model.safetensors`` and ``optimizer.safetensors`` may have to fit
    ``state``'s objects: a larger file is refused by name before a buffer for it is allocated, whatever
    size the manifest claims (issue 26, item 3)."""
    model_bytes = sum(t.numel() * t.element_size() for t in model_target(state).values())
    return {
        # twice the model: a checkpoint written in wider dtypes than the objects now hold still counts
        MODEL: 2 * model_bytes + _HEADER_ROOM,
        OPTIMIZER: _OPTIMIZER_PER_PARAMETER_BYTE * model_bytes + _HEADER_ROOM,
    }


def _check_world_change(
    directory: Spot, world: int, now: int, loadable: Loadable, state: TrainState
) -> Loadable:
    """A position inside an epoch becomes global; what cannot be carried over exactly is refused.

    The epoch then continues from ``resumed_at = (epoch, consumed)`` at batch 0:
    the rest of its order, dealt afresh to ``now`` ranks (``Sharding.consumed``).
    """
    if state.rank_extras:
        msg = (
            f"{directory}: written by {world} processes, restored by {now}: rank_extras "
            f"{sorted(state.rank_extras)} belong to the ranks that wrote them; resume with {world} "
            "processes, or restore without rank_extras"
        )
        raise CheckpointError(msg)
    at = loadable.resumed_at
    before = at[1] if at is not None and at[0] == loadable.epoch else 0
    if loadable.position == 0 and before == 0:
        return attrs.evolve(loadable, resumed_at=None)  # an epoch boundary: nothing to carry over
    where = (
        f"{directory}: written by {world} processes at batch {loadable.position} of epoch "
        f"{loadable.epoch}, restored by {now}"
    )
    if loadable.consumed is None:
        msg = (
            f"{where}: a position inside an epoch counts batches of {world} ranks, and {now} rank(s) "
            "read the epoch in other batches, and this checkpoint does not record the global position "
            "(it was saved without TrainState.loader). Resume with "
            f"{world} processes, or from a checkpoint written at an epoch boundary (state.position "
            "== 0), or save with TrainState.create(..., loader=loader) so that the next checkpoints "
            "restore at any world size; faccel.load_model reads the weights alone"
        )
        raise CheckpointError(msg)
    loader = state.loader
    if loader is None:
        msg = (
            f"{where}: the epoch continues from position {loadable.consumed} of its global order, "
            f"which {now} rank(s) deal afresh; pass the training loader to the TrainState you restore "
            "into (TrainState.create(..., loader=loader)) and iterate loader.resume(state), so that "
            "the epoch is not read again from its start"
        )
        raise CheckpointError(msg)
    if loadable.consumed > loader.sharding.num_samples:
        msg = (
            f"{where}: {loadable.consumed} samples of the epoch were read, but the loader given has "
            f"{loader.sharding.num_samples}; restore with the dataset that was saved"
        )
        raise CheckpointError(msg)
    return attrs.evolve(loadable, position=0, resumed_at=(loadable.epoch, loadable.consumed))


@setup_checked
def restore(
    dist: DistState,
    train_state: TrainState,
    path: str | os.PathLike[str],
    *,
    arrival_timeout: datetime.timedelta = DEFAULT_ARRIVAL,
    into: str | os.PathLike[str] | None = None,
    rollback: Rollback | None = None,
) -> TrainState:
    """Load a checkpoint into ``train_state``'s objects and return the saved TrainState.

    ``path`` is one checkpoint folder, or a root folder of them (then the
    latest complete one, see :func:`latest_checkpoint`; when its files fail
    their check, the newest one before it that passes, with a
    :class:`~faccel.errors.CheckpointWarning` naming both). Everything is checked
    before any object is touched: the manifest's format and version, every
    file's presence, size and SHA-256, and the saved keys, shapes, dtypes and
    classes against the model, optimizer, scheduler, scaler and extras given.
    Then the model, optimizer, scheduler and scaler are loaded in place,
    objects among the extras through ``load_state_dict``, and this rank's
    Python, NumPy, torch (and CUDA) random generators are set as they were.
    From a sharded checkpoint each rank reads only the rows its target holds
    (its own shard of an FSDP2 model, at any world size), each hash block it
    reads checked against its SHA-256.

    Resume the data where it stopped with ``loader.resume(state)``: the
    batches an uninterrupted run would have read next, without reading the
    skipped ones. At another world size, a position inside an epoch comes
    back as ``position=0, resumed_at=(epoch, consumed)`` (the positions of the
    epoch's order all ranks had read, recorded when the saved TrainState had
    its ``loader``), and ``loader.resume(state)`` deals the rest of the epoch
    to the new ranks; a rank the checkpoint has no generators of seeds them
    from ``(dist.seed, step, rank)``. Under DDP call it on every rank; each
    rank gets its own ``rank_extras``.

    Args:
        dist: The run's :class:`DistState`, of any world size (an FSDP2 model
            is resharded).
        train_state: The objects to load into, built as when saving; its
            extras name the entries to restore (any placeholder value; where
            it holds a tensor, the saved one must match its shape and dtype);
            the same for ``rank_extras``.
        path: A checkpoint folder, or a root folder of checkpoints; or their URL on object
            storage (docs/object-storage.md).
        arrival_timeout: How long the ranks that called ``restore`` wait for
            the others to call it too, before raising.
        into: The root this run checkpoints into, when not ``path``'s own:
            then ``path`` may be any committed checkpoint (an older step of a
            root that holds later ones, a named one, a folder of an archived or
            read-only root), which is only read; ``into`` must hold no
            checkpoint after the restored step.
        rollback: Go back to the checkpoint folder ``path`` within its root:
            ``"move"`` moves the root's later numbered checkpoints into
            ``root/abandoned-after-step-N/`` (a loss spike's way back, kept for
            a look), ``"delete"`` deletes them; done by the writing rank under
            the root's lock, after the checkpoint passed its checks and before
            anything is loaded. Without ``into`` or ``rollback``, a folder of a
            root that holds later checkpoints is refused.

    Returns:
        A new TrainState: the same objects, with the saved step, epoch,
        position, extras and this rank's rank extras.

    Raises:
        CheckpointError: No checkpoint at ``path``, or one that is corrupted,
            truncated, foreign, of another version, or does not fit the
            objects; a folder of a root that holds later checkpoints (without
            ``into`` or ``rollback``), an ``into`` root that does; at
            another world size: a position inside an epoch that
            the checkpoint does not record globally (saved without
            ``TrainState.loader``), a target without ``loader``, or
            ``rank_extras``; every checkpoint of a root is broken; a rank did not
            call ``restore`` within ``arrival_timeout``. The message names the file and the problem,
            and nothing has been modified.

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
    check_restore_choice(into, rollback)
    breadcrumb(dist, "restore", step=train_state.step)
    # A non-blocking checkpoint still being written is committed first.
    wait_for_background(dist.runtime, dist, call="restore")
    arrive(dist, "restore", timeout=arrival_timeout, raises=CheckpointError)
    # One listing of the root and one read of the chosen manifest per rank, inside the agreement.
    found = together(
        dist,
        lambda: _find(spot_of(path), into=None if into is None else spot_of(into), rollback=rollback),
        what="finding the checkpoint",
        raises=CheckpointError,
    )
    passed: list[tuple[Spot, str]] = list(found.passed)
    candidates: list[FolderManifest | Spot] = [found.chosen, *found.older]
    for candidate in candidates:
        got = together(
            dist,
            functools.partial(_read_unless_broken, dist, train_state, candidate, single=found.single),
            what="checking the checkpoint",
            raises=CheckpointError,
        )
        uncommitted = isinstance(got, _Uncommitted)
        step, result = (0, None) if isinstance(got, _Uncommitted) else got
        broken = isinstance(result, _Broken)
        # One collective: whether any rank found it broken (or not committed), and the steps found.
        # The rollback too: the writing rank's choice alone would be done, another rank's dropped.
        choice = _CHOICES.index(rollback)  # a known one: check_restore_choice ran first
        flags = agree_max(
            dist,
            [int(broken or uncommitted), -step, step, -choice, choice],
            what="restore's check of the files",
            raises=CheckpointError,
        )
        if -flags[3] != flags[4]:
            msg = (
                f"restore(..., rollback={rollback!r}) on rank {dist.rank}: the ranks passed different "
                f"rollback= values (from {_CHOICES[-flags[3]]!r} to {_CHOICES[flags[4]]!r}); pass the same "
                "on every rank. Nothing was moved, deleted or loaded"
            )
            raise CheckpointError(msg)
        if not flags[0] and result is not None and not isinstance(result, _Broken):
            if -flags[1] != flags[2]:
                msg = (
                    f"{path}: the ranks found different checkpoints (steps {-flags[1]} to {flags[2]}); "
                    "all ranks must see one shared storage"
                )
                raise CheckpointError(msg)
            if passed:
                skipped = "; ".join(f"{folder.name} ({why})" for folder, why in passed)
                warnings.warn(
                    f"{path}: restored {_name(candidate)}, the newest complete checkpoint, and passed "
                    f"over the later broken one(s): {skipped}",
                    CheckpointWarning,
                    stacklevel=3,
                )
            if rollback is not None:  # a single folder (refuse_later): the chosen one
                _roll_back(dist, _folder(candidate), step, rollback)
            return load(train_state, *result)
        if uncommitted:
            continue
        why = result.why if isinstance(result, _Broken) else "broken on another rank"
        passed.append((_folder(candidate), why))
    # The latest one's own error first (alone when it is the only one), then the older ones'.
    msg = passed[0][1]
    if len(passed) > 1:
        older_ones = "; ".join(f"{folder.name} ({why})" for folder, why in passed[1:])
        msg += f". And every checkpoint before it in {path} is broken too: {older_ones}"
    raise CheckpointError(msg)


def _folder(candidate: FolderManifest | Spot) -> Spot:
    return candidate.folder if isinstance(candidate, FolderManifest) else candidate


def _name(candidate: FolderManifest | Spot) -> str:
    return _folder(candidate).name


# restore's rollback= values, numbered for the ranks' agreement.
_CHOICES: tuple[Rollback | None, ...] = (None, *get_args(Rollback))


@attrs.frozen(kw_only=True)
class _Found:
    """What one listing of a root gave: the chosen checkpoint's manifest (read once), the damaged
    later folders passed over, the older step folders to fall back to (their manifests unread)."""

    chosen: FolderManifest
    single: bool
    passed: tuple[tuple[Spot, str], ...] = ()
    older: tuple[Spot, ...] = ()


def _find(path: Spot, *, into: Spot | None, rollback: Rollback | None) -> _Found:
    """``path`` as one checkpoint, or a root's newest complete one: one listing, manifests read newest
    first until one counts (a damaged one is passed over, an uncommitted one on an object store is
    not a checkpoint at all)."""
    own = read_folder_manifest(path)
    if own.step is not None:
        # Restoring one folder of a root that holds later checkpoints: the run would collide with
        # them at its first later checkpoint, hours in, or leave them as a "latest" not this run's.
        refuse_later(path, own.step, folder=True, into=into, rollback=rollback)
        return _Found(chosen=own, single=True)
    listing = scan(path)
    passed: list[tuple[Spot, str]] = []
    for index, (_, folder) in enumerate(listing.folders):
        manifest = read_folder_manifest(folder)
        if manifest.step is not None:
            refuse_later(path, manifest.step, folder=False, into=into, rollback=rollback)
            older = tuple(f for _, f in listing.folders[index + 1 :])
            return _Found(chosen=manifest, single=False, passed=tuple(passed), older=older)
        if counted(manifest):
            passed.append((folder, manifest.why or ""))
    msg = (
        f"{path}: no checkpoint there: neither a checkpoint folder (it has no valid {MANIFEST}) "
        f"nor a folder of complete checkpoints (step-NNNNNNNNNNNN/{MANIFEST})"
    )
    raise CheckpointError(msg)


def _roll_back(dist: DistState, folder: Spot, step: int, how: Rollback) -> None:
    """The writing rank sets the later checkpoints of ``folder``'s root aside; every rank waits for it."""

    def work() -> None:
        if dist.is_main_process:
            set_aside(folder, step, how)

    together(dist, work, what=f"the rollback to {folder.name}", raises=CheckpointError)


@attrs.frozen
class _Broken:
    """A checkpoint of a root whose files fail their check: passed over for an older one, with why."""

    why: str


@attrs.frozen
class _Uncommitted:
    """A step folder without a manifest on an object store: a write not committed, not a checkpoint."""


def _read_unless_broken(
    dist: DistState, state: TrainState, candidate: FolderManifest | Spot, *, single: bool
) -> tuple[int, tuple[Loadable, Generators | NewRank] | _Broken] | _Uncommitted:
    """The checkpoint's step and its content read and checked, or (from a root) why its files are
    broken; its manifest is read here only when it was not read yet (an older one to fall back to)."""
    manifest = candidate if isinstance(candidate, FolderManifest) else read_folder_manifest(candidate)
    if manifest.step is None and not counted(manifest):
        return _Uncommitted()
    # One listing of the folder, on one rank: a name the manifest does not list is damage.
    stray = stray_names(manifest.folder, manifest.manifest) if dist.is_main_process else None
    if stray is not None:
        if single:
            raise CheckpointError(stray)
        return manifest.step or 0, _Broken(why=stray)
    try:
        return manifest.step or 0, _read_checkpoint(dist, state, manifest)
    except _BrokenError as error:
        if single:
            raise CheckpointError(str(error)) from None
        return manifest.step or 0, _Broken(why=str(error))
