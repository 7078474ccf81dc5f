"""The root folder of a run's checkpoints: which are complete, the latest, rotation, leftovers.

A checkpoint counts once its ``step-NNNNNNNNNNNN`` folder holds a faccel
manifest: the manifest is written last (``Store.commit``). On a disk the folder
appears by one rename, so a step folder without a valid manifest was damaged
after its commit; on an object store the manifest's write is the commit, so a
step prefix without one is a write not committed (invisible, and removed by
the next checkpoint). Folders of interrupted writes and deletions never count.
A checkpoint moved aside by ``replace=True`` (on a disk, for the moment its
replacement is renamed in) counts as its step while ``step-N`` is absent.

Every file call goes through the root's store (``faccel._storage._store``).
One writer per root: the writing rank holds the store's lock (``Store.lock``:
an OS lock on a disk, a lease object on an object store) for the whole write,
so a second writer fails at once with a :class:`CheckpointError` naming the
first one, and whoever holds the lock may treat every uncommitted folder as a
dead writer's leftover.

A root is listed once per question: :func:`scan` lists it and returns the
step folders newest first; :func:`read_folder_manifest` reads one folder's manifest,
once, and the bytes read are those restore checks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import attrs

from faccel._checkpoint._format import CHECKPOINT_FILE, LEFTOVER, MANIFEST, REPLACED, STEP_FOLDER
from faccel._checkpoint._manifest import Manifest, step_of
from faccel._storage._durable import MAX_MANIFEST, parse_json
from faccel._storage._roots import shown, spot_of
from faccel._storage._store import Lease, Spot
from faccel._typecheck import setup_checked
from faccel.errors import CheckpointError

__all__ = [
    "FolderManifest",
    "Listing",
    "blocking_file",
    "check_lock",
    "complete_checkpoints",
    "counted",
    "find_latest",
    "hold_lock",
    "latest_checkpoint",
    "manifest_step",
    "read_folder_manifest",
    "remove_leftovers",
    "rotate",
    "scan",
    "writable_root",
]


@attrs.frozen(kw_only=True)
class FolderManifest:
    """A folder's manifest, read once: its step, or why the folder does not count.

    A folder counts when its manifest is faccel's and names an integer step (``step``). Its
    record (:class:`~faccel._checkpoint._manifest.Manifest`) is decoded once, here: ``manifest``, or
    ``refused`` (why :meth:`Manifest.decode` refuses it; a folder that counts whose manifest is
    refused is a named error at restore, not passed over).
    """

    folder: Spot
    step: int | None = None
    why: str | None = None
    manifest: Manifest | None = None
    refused: str | None = None


def read_folder_manifest(folder: Spot) -> FolderManifest:
    """``folder``'s faccel manifest, read, parsed and decoded once (a missing or damaged one says why)."""
    where = str(folder / MANIFEST)
    store = folder.store
    try:
        buffer, _ = store.read((folder / MANIFEST).key, None, where=where, limit=MAX_MANIFEST)
        raw = parse_json(buffer.numpy().tobytes(), where)
    except (CheckpointError, OSError) as error:
        why = str(error) if isinstance(error, CheckpointError) else f"{where}: {error}"
        return FolderManifest(folder=folder, why=why)
    step = step_of(raw, where=where)
    if isinstance(step, str):
        return FolderManifest(folder=folder, why=step)
    try:
        return FolderManifest(folder=folder, step=step, manifest=Manifest.decode(raw, where=where))
    except CheckpointError as error:
        return FolderManifest(folder=folder, step=step, refused=str(error))


def manifest_step(directory: Spot | str | os.PathLike[str]) -> int | None:
    """The step of a complete checkpoint folder (one with a faccel manifest), else None."""
    return read_folder_manifest(spot_of(directory)).step


@attrs.frozen(kw_only=True)
class Listing:
    """A root listed once: its step folders (with the ones set aside by a replace), newest first."""

    root: Spot
    folders: tuple[tuple[int, Spot], ...]

    def steps(self) -> Iterator[FolderManifest]:
        """Each step folder's manifest, newest first, read as it is reached (a lazy walk)."""
        return (read_folder_manifest(folder) for _, folder in self.folders)


def scan(root: Spot) -> Listing:
    """One listing of ``root``: its ``step-N`` folders, newest first (a ``.replaced-step-N`` stands
    for step N while ``step-N`` is absent)."""
    found: dict[int, Spot] = {}
    aside: dict[int, Spot] = {}
    for entry in root.store.list(root.key):
        if not entry.folder:
            continue
        match = STEP_FOLDER.fullmatch(entry.name)
        replaced = REPLACED.fullmatch(entry.name)
        if match:
            found[int(match.group(1))] = root / entry.name
        elif replaced and replaced.group(2) is not None:  # a named one is never a root's latest
            aside[int(replaced.group(2))] = root / entry.name
    folders = {**aside, **found}
    return Listing(root=root, folders=tuple(sorted(folders.items(), reverse=True)))


def counted(manifest: FolderManifest) -> bool:
    """Whether a folder without a valid manifest is damaged (a disk: it was committed by a rename)
    rather than a write never committed (an object store)."""
    if manifest.step is not None:
        return True
    store = manifest.folder.store
    return store.renames or store.size((manifest.folder / MANIFEST).key) is not None


def complete_checkpoints(root: Spot | Path) -> list[tuple[int, Spot]]:
    """``(step, folder)`` of every complete checkpoint under ``root``, oldest first."""
    listing = scan(spot_of(root))
    return sorted((step, folder) for step, folder in listing.folders if manifest_step(folder) is not None)


def find_latest(path: Spot) -> FolderManifest | None:
    """The manifest of ``path`` itself when it is a checkpoint, else of its newest complete one
    (one listing; manifests read newest first until one counts)."""
    own = read_folder_manifest(path)
    if own.step is not None:
        return own
    for manifest in scan(path).steps():
        if manifest.step is not None:
            return manifest
    return None


@setup_checked
def latest_checkpoint(path: str | os.PathLike[str]) -> Path | str | None:
    """The latest complete checkpoint at ``path``, or None when there is none.

    ``path`` may be a checkpoint folder itself (returned as is when complete),
    or a root folder of ``step-NNNNNNNNNNNN`` checkpoints, of which the one
    with the highest step counts (only folders with a faccel manifest count;
    folders being written never count: on a disk they are named
    ``.tmp-...``, on an object store they have no manifest yet). No
    symlink, no "latest" file: nothing to race with. ``path`` may be a URL
    (``s3://bucket/run``, docs/object-storage.md); the result is then a URL.

    Args:
        path: A checkpoint, or a root folder of them.

    Returns:
        The checkpoint folder (a :class:`~pathlib.Path`, or a URL string), or None.

    Example:
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    found = find_latest(spot_of(path))
    return shown(found.folder) if found is not None else None


def remove_leftovers(root: Spot) -> None:
    """Delete what interrupted writes and deletions left (invisible to restore anyway).

    The caller holds the root's lock (:func:`hold_lock`): no other writer is
    alive, so every uncommitted folder is a dead writer's. A committed
    checkpoint is never removed.
    """
    root.store.leftovers(root.key, counts=lambda key: manifest_step(Spot(root.store, key)) is not None)
    if not root.store.renames:
        # An object store: a step prefix without a manifest is a write that never committed (one
        # size request per prefix, not a read of each manifest). Only the objects a checkpoint's
        # writers name go, directly in it: never a "subfolder" (another run's root nested there,
        # s3://b/exp/step-000000000005/...), never an object of a name no writer of ours gives.
        for _, folder in scan(root).folders:
            if root.store.size((folder / MANIFEST).key) is None:
                for entry in folder.entries():
                    if not entry.folder and CHECKPOINT_FILE.fullmatch(entry.name):
                        root.store.delete((folder / entry.name).key)


def writable_root(path: str | os.PathLike[str] | Spot) -> Spot:
    """``path`` as a root to write checkpoints into; on an object store, not one inside a checkpoint's
    name (``s3://b/exp/step-000000000005``): a run into ``s3://b/exp`` would take that prefix for
    its own write never committed.

    Raises:
        CheckpointError: A root on an object store with a checkpoint folder's name in its key.
    """
    root = spot_of(path)
    if root.store.renames:
        return root  # a disk: its cleanup takes hidden .tmp-/.trash- folders only, never a step-N
    names = [name for name in root.key.split("/") if STEP_FOLDER.fullmatch(name) or LEFTOVER.fullmatch(name)]
    names += [name for name in root.key.split("/") if REPLACED.fullmatch(name)]
    if names:
        msg = (
            f"{root}: a checkpoint root inside a checkpoint folder's name ({names[0]}): on an object "
            f"store, a run into the root above it would take {names[0]} for a write of its own that never "
            "committed, and its cleanup would reach this root's checkpoints. Give the run a root of "
            "other names (s3://bucket/exp/run-5, not s3://bucket/exp/step-000000000005)"
        )
        raise CheckpointError(msg)
    return root


def blocking_file(path: Spot | Path) -> str | None:
    """``path`` or the first of its parents that exists, when that one is not a folder."""
    spot = spot_of(path)
    return spot.store.blocking_file(spot.key)


def rotate(root: Spot, keep: int, step: int) -> None:
    """Delete the oldest checkpoints before ``step``, so that ``keep`` remain with it."""
    older = [folder for s, folder in complete_checkpoints(root) if s < step]
    for folder in older[: max(0, len(older) - (keep - 1))]:
        root.store.retire(folder.key, committed=True)


@contextlib.contextmanager
def hold_lock(root: Spot) -> Iterator[Lease]:
    """Hold ``root``'s writer lock for the ``with`` block (``Store.lock``; a second writer is refused)."""
    with root.store.lock(root.key) as lease:
        yield lease


def check_lock(root: Spot, lease: Lease) -> str | None:
    """None while ``lease`` still holds ``root``, else what happened to it."""
    return root.store.check_lock(lease)
