"""The local disk as a :class:`~faccel._storage._store.Store`: fsync, rename, an OS lock, O_DIRECT reads.

Keys are absolute paths. Files are written by ``_durable`` (hashed while
written, fsynced, early writeback), read by it (a regular file only, its size
checked before a byte is allocated). A checkpoint is written into a hidden
sibling ``.tmp-NAME`` and committed by one rename after the manifest is
written and every file and the folder are fsynced: a crash leaves the
previous checkpoints whole and the partial folder invisible. Replacing a
committed folder moves it aside as ``.replaced-NAME`` for the moment between
the two renames (readers count it as NAME while NAME is absent); a deleted
one is renamed ``.trash-NAME`` first, so it is invisible at once.

One writer per root: :meth:`LocalStore.lock` holds ``fcntl.flock`` on
``ROOT/.lock`` (released by the OS when the process dies); a lock won on a
file no longer at that path is retried, and the lock file's identity (device,
inode) is checked before the commit. POSIX only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl  # POSIX only: faccel does not target Windows
import os
import shutil
import socket
import stat
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from faccel._storage._durable import (
    BLAKE3,
    FileRecord,
    SyncedWriter,
    atomic_write,
    fsync_dir,
    open_regular,
    read_verified,
    scratch_buffer,
    write_durably,
)
from faccel._storage._names import ASIDE, LOCK, TMP, TRASH
from faccel._storage._store import Entry, Lease, Spot
from faccel.errors import CheckpointError

__all__ = [
    "LOCAL",
    "LocalStore",
    "local_spot",
]

# One read() moves at most this much on Linux.
_READ_CHUNK = 1 << 30
# O_DIRECT reads: offsets, lengths and buffers aligned to this (a page; any block size up to it).
_ALIGN = 4096


@attrs.frozen(kw_only=True)
class _Held:
    """What a held local lock keeps: the open descriptor and the lock file's identity."""

    fd: int
    device: int
    inode: int


class _LocalWriter:
    """A new file through :class:`SyncedWriter`; the head is patched with ``pwrite``."""

    def __init__(self, path: Path) -> None:
        self._out = SyncedWriter(path)

    def __enter__(self) -> _LocalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._out.__exit__(*exc)

    def write(self, chunk: Any) -> None:
        self._out.write(chunk)

    def patch_head(self, data: bytes) -> None:
        os.pwrite(self._out.fd, data, 0)

    def close(self) -> int:
        return self._out.close()


class _LocalPublisher(_LocalWriter):
    """A new file written to ``.tmp-NAME`` beside ``path``, renamed to ``path`` when closed."""

    def __init__(self, path: Path) -> None:
        self._final = path
        self._temporary = path.with_name(TMP + path.name)
        self._temporary.unlink(missing_ok=True)
        super().__init__(self._temporary)

    def close(self) -> int:
        size = super().close()
        os.replace(self._temporary, self._final)
        return size


class _LocalReader:
    """An open regular file: ``pread`` through the page cache, or ``O_DIRECT`` around it."""

    def __init__(self, path: Path, where: str, within: Sequence[Path] = (), *, direct: bool = True) -> None:
        self.where = where
        self.fd = open_regular(path, where=where, within=within)
        self.size = os.fstat(self.fd).st_size
        self.direct_fd = _reopen_direct(self.fd) if direct else -1
        self.direct_works = True

    def read_into(self, target: Any, offset: int, at_least: int | None = None) -> None:
        _pread(self.fd, target, offset, self.where, at_least)

    def direct(self, offset: int, need: int, scratch: dict[str, Any]) -> Any:
        """None when this file has no O_DIRECT descriptor, or its file system refuses the read
        (then the rest of the file is read through the cache)."""
        if self.direct_fd < 0 or not self.direct_works:
            return None
        low = offset - offset % _ALIGN
        high = -(-(offset + need) // _ALIGN) * _ALIGN
        buffer = scratch_buffer(scratch, "direct", high - low)[: high - low]
        try:
            _pread(self.direct_fd, buffer, low, self.where, at_least=offset + need - low)
        except OSError as error:
            if error.errno != errno.EINVAL:
                raise
            self.direct_works = False  # an alignment this file system does not take
            return None
        return buffer[offset - low : offset - low + need]

    def close(self) -> None:
        os.close(self.fd)
        if self.direct_fd >= 0:
            os.close(self.direct_fd)


def _pread(fd: int, target: Any, offset: int, where: str, at_least: int | None = None) -> None:
    """Fill ``target`` from ``offset`` (its first ``at_least`` bytes: the file may end sooner)."""
    view = memoryview(target).cast("B")
    want = len(view) if at_least is None else at_least
    done = 0
    while done < want:
        got = os.preadv(fd, [view[done : done + _READ_CHUNK]], offset + done)
        if not got:
            msg = f"{where}: the file shrank while it was read"
            raise CheckpointError(msg)
        done += got


def _reopen_direct(fd: int) -> int:
    """A second descriptor on the same file that reads around the page cache, or -1."""
    if not hasattr(os, "O_DIRECT"):
        return -1
    try:
        return os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    except OSError:
        return -1


@attrs.frozen
class LocalStore:
    """The local file system (and any POSIX file system mounted on it); keys are paths."""

    local: bool = True
    renames: bool = True

    def display(self, key: str) -> str:
        return key

    def join(self, key: str, name: str) -> str:
        return os.path.join(key, name)

    def parent(self, key: str) -> str:
        return os.fspath(Path(key).parent)

    def canonical(self, key: str) -> str:
        return os.path.abspath(key)

    def list(self, key: str) -> list[Entry]:
        try:
            entries = list(os.scandir(key))
        except (FileNotFoundError, NotADirectoryError):
            return []
        found = []
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                found.append(Entry(name=entry.name, folder=True))
            elif entry.is_file(follow_symlinks=False):
                size = entry.stat(follow_symlinks=False).st_size
                found.append(Entry(name=entry.name, folder=False, size=size))
            else:  # a link, a FIFO, a socket: a name, never a regular file of a size
                found.append(Entry(name=entry.name, folder=False))
        return found

    def size(self, key: str) -> int | None:
        try:
            info = os.stat(key, follow_symlinks=False)
        except OSError:
            return None
        return info.st_size if stat.S_ISREG(info.st_mode) else None

    def is_folder(self, key: str) -> bool:
        return os.path.isdir(key)

    def blocking_file(self, key: str) -> str | None:
        path = Path(key)
        for candidate in (path, *path.parents):  # os.path: an unreadable name is for mkdir to report
            if os.path.exists(candidate):
                return None if os.path.isdir(candidate) else str(candidate)
            if os.path.islink(candidate):  # a dangling link: no folder can be made through it
                return str(candidate)
        return None

    def make_folder(self, key: str) -> None:
        Path(key).mkdir(parents=True, exist_ok=True)

    def exists(self, key: str) -> bool:
        return os.path.lexists(key)

    def resolve(self, key: str) -> str:
        return os.path.realpath(key)

    def occupied(self, key: str) -> int:
        stored = 0
        for entry in os.scandir(key):
            if entry.is_file(follow_symlinks=False):
                info = entry.stat(follow_symlinks=False)
                stored += min(info.st_size, getattr(info, "st_blocks", info.st_size // 512 + 1) * 512)
        return stored

    def folder_visible(self, key: str) -> bool:
        return os.path.isdir(key)

    def write(self, key: str, chunks: Sequence[Any], *, algorithm: str = BLAKE3) -> FileRecord:
        return write_durably(Path(key), chunks, algorithm=algorithm)

    def writer(self, key: str) -> _LocalWriter:
        return _LocalWriter(Path(key))

    def publisher(self, key: str) -> _LocalPublisher:
        return _LocalPublisher(Path(key))

    def sync_folder(self, key: str) -> None:
        fsync_dir(Path(key))

    def replace(self, key: str, chunks: Sequence[Any]) -> FileRecord:
        return atomic_write(Path(key), chunks)

    def read(
        self,
        key: str,
        expected: FileRecord | None,
        *,
        where: str,
        limit: int | None = None,
        algorithm: str = BLAKE3,
        within: Sequence[str | os.PathLike[str]] = (),
    ) -> tuple[torch.Tensor, FileRecord]:
        return read_verified(
            Path(key),
            expected,
            where=where,
            limit=limit,
            algorithm=algorithm,
            within=tuple(Path(folder) for folder in within),
        )

    def open(self, key: str, *, where: str, within: Sequence[Path] = (), direct: bool = True) -> _LocalReader:
        """``within``: links are followed while the real path stays inside one of these folders
        (``_durable.open_regular``); a checkpoint's files are never links (``within`` empty).
        ``direct=False``: no second descriptor for reads around the page cache (a reader of
        whole tensors through the cache, as ``load_model``'s, needs none)."""
        return _LocalReader(Path(key), where, within, direct=direct)

    def delete(self, key: str) -> None:
        if os.path.isdir(key) and not os.path.islink(key):
            shutil.rmtree(key, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(key)

    def staging(self, final: str) -> str:
        head, name = os.path.split(final)
        return os.path.join(head, TMP + name)

    def commit(
        self,
        staging: str,
        final: str,
        manifest_name: str,
        manifest: Sequence[Any],
        *,
        check: Callable[[str, bool], None],
    ) -> FileRecord:
        record = write_durably(Path(staging) / manifest_name, manifest)
        fsync_dir(Path(staging))
        check(staging, False)  # a folder emptied under us is never committed
        root, name = os.path.split(final)
        aside = None
        if os.path.exists(final):
            # Replacing: the old one aside, then the new one in. Between the two renames the
            # folder aside counts as this step (see leftovers), so a crash leaves one of the two.
            aside = os.path.join(root, ASIDE + name)
            os.rename(final, aside)
        os.rename(staging, final)
        fsync_dir(Path(root))
        try:
            check(final, False)  # (a failure renames it out of sight: not committed)
        except CheckpointError:
            with contextlib.suppress(OSError):  # ours and broken: out of sight (restore passes it over)
                os.rename(final, os.path.join(root, TRASH + name))
            raise
        if aside is not None:
            self._trash(aside, os.path.join(root, TRASH + name))
        return record

    def _trash(self, folder: str, trash: str) -> None:
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(folder, trash)  # invisible at once; deleting the files can then take its time
        fsync_dir(Path(os.path.dirname(trash)))
        shutil.rmtree(trash, ignore_errors=True)

    def retire(self, folder: str, *, committed: bool) -> None:
        root, name = os.path.split(folder)
        self._trash(folder, os.path.join(root, TRASH + name))

    def move(self, folder: str, target: str) -> None:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(folder, target)
        fsync_dir(Path(os.path.dirname(target)))
        fsync_dir(Path(os.path.dirname(folder)))

    def aside(self, folder: str) -> str:
        """Where ``folder`` waits while its replacement is renamed in (it counts as ``folder`` then)."""
        root, name = os.path.split(folder)
        return os.path.join(root, ASIDE + name)

    def leftovers(self, root: str, *, counts: Callable[[str], bool]) -> None:
        """A checkpoint left aside by an interrupted replace goes back to its name when the
        replacement never arrived, and is deleted when it did; ``.tmp-`` and ``.trash-`` folders
        (dead writers' and deleters') are deleted."""
        renamed = False
        for entry in os.scandir(root):
            if entry.name.startswith(ASIDE) and entry.is_dir(follow_symlinks=False):
                final = os.path.join(root, entry.name[len(ASIDE) :])
                if not os.path.exists(final):
                    os.rename(entry.path, final)
                    renamed = True
                elif counts(final):
                    trash = os.path.join(root, TRASH + entry.name[len(ASIDE) :])
                    shutil.rmtree(trash, ignore_errors=True)
                    os.rename(entry.path, trash)
                    renamed = True
        if renamed:
            fsync_dir(Path(root))
        for entry in os.scandir(root):
            hidden = entry.name.startswith((TMP, TRASH))
            if hidden and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)

    @contextlib.contextmanager
    def lock(self, root: str) -> Iterator[Lease]:
        """Non-blocking: a root locked by another live process raises at once. The file is unlinked
        before it is unlocked, and a lock won on a file no longer at ``root/.lock`` is retried, so
        two writers never hold locks on two different files at once."""
        path = os.path.join(root, LOCK)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise
                msg = (
                    f"{root}: another process is writing a checkpoint into this folder "
                    f"({_holder(path)}, holds {path}): one writer per checkpoint root. Give each run "
                    "its own folder, or stop the other run first"
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
        held = _Held(fd=fd, device=own.st_dev, inode=own.st_ino)
        lease = Lease(key=path, token=f"{own.st_dev}:{own.st_ino}", handle=held)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"host {socket.gethostname()}, pid {os.getpid()}\n".encode())
            yield lease
        finally:
            try:
                if self.check_lock(lease) is None:
                    os.unlink(path)
            except OSError:
                pass  # the root is gone: nothing to tidy
            os.close(fd)  # releases the lock

    def check_lock(self, lease: Lease) -> str | None:
        try:
            now = os.stat(lease.key, follow_symlinks=False)
        except FileNotFoundError:
            return f"{lease.key} was removed (the root deleted?)"
        except OSError as error:
            return f"{lease.key} cannot be checked ({error})"
        if f"{now.st_dev}:{now.st_ino}" != lease.token:
            return f"{lease.key} was replaced by another file (the root deleted and made again?)"
        return None


def _holder(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            text = handle.read(200).decode("utf-8", "replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not yet written its pid"


LOCAL = LocalStore()


def local_spot(path: str | os.PathLike[str] | Spot) -> Spot:
    """``path`` on the local disk (its key the path as given, so that messages show it so); a
    :class:`Spot` is returned as it is."""
    return path if isinstance(path, Spot) else Spot(LOCAL, os.fspath(path))
