"""The root folder of a run's checkpoints: which are complete, the latest, rotation, leftovers.

A checkpoint counts once its ``step-NNNNNNNNNNNN`` folder holds a faccel
manifest: the manifest is written last, and the folder appears by one rename.
Folders of interrupted writes and deletions (``.tmp-``, ``.trash-``) never
count, and the next checkpoint removes them. A ``.replaced-step-N`` folder (a
checkpoint moved aside by ``replace=True`` for the moment its replacement is
renamed in) counts as step N while ``step-N`` is absent: a crash between the
two renames leaves it, and the next checkpoint renames it back.

One writer per root: the writing rank holds an OS lock (``fcntl.flock``) on
``ROOT/.lock`` for the whole write, released by the OS when the process dies,
so a second writer fails at once with a :class:`CheckpointError` naming the
first one's pid, and whoever holds the lock may treat every ``.tmp-`` and
``.trash-`` folder as a dead writer's leftover. POSIX only (``fcntl``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl  # POSIX only: faccel does not target Windows
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import attrs

from faccel._checkpoint._format import FORMAT, LEFTOVER, MANIFEST, REPLACED, STEP_FOLDER, trash_name
from faccel._storage._durable import MAX_MANIFEST, fsync_dir, read_json
from faccel._typecheck import setup_checked
from faccel.errors import CheckpointError

__all__ = [
    "LOCK",
    "RootLock",
    "blocking_file",
    "check_lock",
    "complete_checkpoints",
    "damaged_checkpoints",
    "hold_lock",
    "latest_checkpoint",
    "manifest_step",
    "remove_leftovers",
    "rotate",
]

# The file a writer locks in the root; it holds the writer's host and pid, for the error of a second one.
LOCK = ".lock"


def manifest_step(directory: Path) -> int | None:
    """The step of a complete checkpoint folder (one with a faccel manifest), else None."""
    step = _manifest(directory)
    return step if isinstance(step, int) else None


def _manifest(directory: Path) -> int | str:
    """The step of ``directory``'s faccel manifest, or why it has none that counts."""
    where = str(directory / MANIFEST)
    try:
        manifest = read_json(directory / MANIFEST, where=where, limit=MAX_MANIFEST)
    except (CheckpointError, OSError) as error:
        return str(error) if isinstance(error, CheckpointError) else f"{where}: {error}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"{where}: not a faccel manifest (its format is not {FORMAT!r})"
    step = manifest.get("step")
    return step if type(step) is int else f"{where}: its step is not an integer, got {step!r}"


def damaged_checkpoints(root: Path, *, after: int) -> list[tuple[Path, str]]:
    """``(folder, why)`` of every ``step-N`` folder under ``root`` with ``N > after`` whose manifest is
    missing or damaged, newest first.

    A ``step-N`` folder appears only by the rename of a complete written folder,
    so one without a valid manifest was damaged after its commit: ``restore``
    warns when it passes one over, as for any other damaged file.
    """
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for entry in entries:
        match = STEP_FOLDER.fullmatch(entry.name)
        if match and int(match.group(1)) > after and entry.is_dir():
            why = _manifest(Path(entry.path))
            if isinstance(why, str):
                found.append((int(match.group(1)), Path(entry.path), why))
    return [(folder, why) for _, folder, why in sorted(found, reverse=True)]


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint under ``root``, oldest first."""
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    found: dict[int, Path] = {}
    replaced: dict[int, Path] = {}
    for entry in entries:
        match = STEP_FOLDER.fullmatch(entry.name)
        aside = REPLACED.fullmatch(entry.name)
        if (match or aside) and entry.is_dir() and manifest_step(Path(entry.path)) is not None:
            if match:
                found[int(match.group(1))] = Path(entry.path)
            elif aside and aside.group(2) is not None:  # a named one is never a root's latest
                replaced[int(aside.group(2))] = Path(entry.path)
    # A checkpoint being replaced stands for its step until the replacement is in place.
    return sorted({**replaced, **found}.items())


@setup_checked
def latest_checkpoint(path: str | os.PathLike[str]) -> Path | None:
    """The latest complete checkpoint at ``path``, or None when there is none.

    ``path`` may be a checkpoint folder itself (returned as is when complete),
    or a root folder of ``step-NNNNNNNNNNNN`` checkpoints, of which the one
    with the highest step counts (only folders with a faccel manifest count;
    folders being written are named ``.tmp-...`` and never count). No
    symlink, no "latest" file: nothing to race with.

    Args:
        path: A checkpoint, or a root folder of them.

    Returns:
        The checkpoint folder, or None.

    Example:
        >>> import tempfile
        >>> latest_checkpoint(tempfile.mkdtemp()) is None
        True
    """
    candidate = Path(path)
    if manifest_step(candidate) is not None:
        return candidate
    complete = complete_checkpoints(candidate)
    return complete[-1][1] if complete else None


def remove_leftovers(root: Path) -> None:
    """Delete folders of interrupted writes and deletions (invisible to restore anyway).

    The caller holds the root's lock (:func:`hold_lock`): no other writer is
    alive, so every ``.tmp-`` and ``.trash-`` folder is a dead writer's.

    A checkpoint left aside by an interrupted replace goes back to its name
    when the replacement never arrived, and is deleted when it did.
    """
    renamed = False
    for entry in os.scandir(root):
        aside = REPLACED.fullmatch(entry.name)
        if aside and entry.is_dir(follow_symlinks=False):
            final = root / aside.group(1)
            if not final.exists():
                os.rename(entry.path, final)
                renamed = True
            elif manifest_step(final) is not None:
                trash = root / trash_name(aside.group(1))
                shutil.rmtree(trash, ignore_errors=True)
                os.rename(entry.path, trash)
                renamed = True
    if renamed:
        fsync_dir(root)
    for entry in os.scandir(root):
        if LEFTOVER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)


def blocking_file(path: Path) -> Path | None:
    """``path`` or the first of its parents that exists, when that one is not a folder."""
    for candidate in (path, *path.parents):  # os.path: an unreadable name is for mkdir to report
        if os.path.exists(candidate):
            return None if os.path.isdir(candidate) else candidate
        if os.path.islink(candidate):  # a dangling link: no folder can be made through it
            return candidate
    return None


def rotate(root: Path, keep: int, step: int) -> None:
    """Delete the oldest checkpoints before ``step``, so that ``keep`` remain with it."""
    older = [folder for s, folder in complete_checkpoints(root) if s < step]
    doomed = older[: max(0, len(older) - (keep - 1))]
    trashed = []
    for folder in doomed:
        trash = root / trash_name(folder.name)
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(folder, trash)  # invisible at once; deleting the files can then take its time
        trashed.append(trash)
    if trashed:
        fsync_dir(root)
    for trash in trashed:
        shutil.rmtree(trash, ignore_errors=True)


@attrs.frozen(kw_only=True)
class RootLock:
    """A held writer lock: the lock file's path, open descriptor and identity (device, inode)."""

    path: Path
    fd: int
    device: int
    inode: int


def _holder(path: Path) -> str:
    try:
        with open(path, "rb") as handle:
            text = handle.read(200).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not yet written its pid"


@contextlib.contextmanager
def hold_lock(root: Path) -> Iterator[RootLock]:
    """Hold ``root``'s writer lock for the ``with`` block; the lock file is removed on release.

    Non-blocking: a root locked by another live process raises at once. The
    OS releases the lock when its holder dies (a stale lock file is simply
    locked again). The file is unlinked before it is unlocked, and a lock
    won on a file no longer at ``root/.lock`` is retried, so two writers never
    hold locks on two different files at once.
    """
    path = root / LOCK
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            os.close(fd)
            if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            msg = (
                f"{root}: another process is writing a checkpoint into this folder ({_holder(path)}, "
                f"holds {path}): one writer per checkpoint root. Give each run its own folder, or "
                "stop the other run first"
            )
            raise CheckpointError(msg) from None
        own = os.fstat(fd)
        try:
            now = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_dev, now.st_ino) == (own.st_dev, own.st_ino):
            break
        os.close(fd)  # won the lock of a file its last holder removed: lock the current one
    lock = RootLock(path=path, fd=fd, device=own.st_dev, inode=own.st_ino)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode())
        yield lock
    finally:
        try:
            if check_lock(lock) is None:
                os.unlink(path)
        except OSError:
            pass  # the root is gone: nothing to tidy
        os.close(fd)  # releases the lock


def check_lock(lock: RootLock) -> str | None:
    """None while ``lock``'s file is still the root's lock file, else what happened to it."""
    try:
        now = os.stat(lock.path, follow_symlinks=False)
    except FileNotFoundError:
        return f"{lock.path} was removed (the root deleted?)"
    except OSError as error:
        return f"{lock.path} cannot be checked ({error})"
    if (now.st_dev, now.st_ino) != (lock.device, lock.inode):
        return f"{lock.path} was replaced by another file (the root deleted and made again?)"
    return None
