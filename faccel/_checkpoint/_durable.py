"""Durable files: written, hashed and fsynced; read back and checked against their hash.

The hash (SHA-256, which runs on the CPU's SHA instructions where present)
is computed from the bytes in memory while they are written, on a second
thread, so it overlaps the write and the fsync instead of re-reading the
file. Reading is the mirror: one ``readinto`` per chunk into a single
buffer, hashed chunk by chunk on a second thread.

POSIX durability needs three fsyncs: the file (its data), the directory that
holds it (its name), and, after a rename, the directory the name moved into.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import torch

from faccel.errors import CheckpointError

__all__ = [
    "FileRecord",
    "atomic_write",
    "check_written",
    "fsync_dir",
    "in_parallel",
    "read_verified",
    "write_durably",
]

T = TypeVar("T")
HASH = "sha256"
# Below this many bytes a second thread costs more than it saves.
_THREAD_BYTES = 1 << 20
_READ_CHUNK = 64 << 20
# One write() moves at most this much on Linux; larger views are written in pieces.
_WRITE_CHUNK = 1 << 30


@attrs.frozen(kw_only=True)
class FileRecord:
    """A file's size in bytes and its SHA-256, as hex."""

    size: int
    sha256: str


class _Hasher:
    """Hashes chunks in order on a background thread (hashlib releases the GIL)."""

    def __init__(self, threaded: bool) -> None:
        self.hash = hashlib.sha256()
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._chunks: list[Any] = []
        self._ready = threading.Condition()
        self._closed = False
        if threaded:
            self._thread = threading.Thread(target=self._run, name="faccel-hash", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._ready:
                    while not self._chunks and not self._closed:
                        self._ready.wait()
                    if not self._chunks:
                        return
                    chunk = self._chunks.pop(0)
                self.hash.update(chunk)
        except BaseException as error:  # pragma: no cover - surfaced by finish()
            self.error = error

    def update(self, chunk: Any) -> None:
        if self._thread is None:
            self.hash.update(chunk)
            return
        with self._ready:
            self._chunks.append(chunk)
            self._ready.notify()

    def finish(self) -> str:
        if self._thread is not None:
            with self._ready:
                self._closed = True
                self._ready.notify()
            self._thread.join()
        if self.error is not None:
            raise self.error
        return self.hash.hexdigest()


def _write_all(fd: int, view: memoryview) -> None:
    offset, size = 0, len(view)
    while offset < size:
        offset += os.write(fd, view[offset : offset + _WRITE_CHUNK])


def write_durably(path: Path, chunks: Sequence[Any]) -> FileRecord:
    """Write ``chunks`` (bytes-like) to a new file at ``path``, fsync it, return its record.

    The caller fsyncs the directory (once for many files).
    """
    views = [memoryview(chunk).cast("B") for chunk in chunks]
    size = sum(len(view) for view in views)
    hasher = _Hasher(threaded=size >= _THREAD_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for view in views:
            hasher.update(view)
            _write_all(fd, view)
        os.fsync(fd)
    finally:
        os.close(fd)
        digest = hasher.finish()
    return FileRecord(size=size, sha256=digest)


def fsync_dir(path: Path) -> None:
    """Make the names in directory ``path`` durable (creations, renames, deletions)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, chunks: Sequence[Any]) -> FileRecord:
    """Replace ``path`` with ``chunks`` atomically: a temporary sibling, fsync, rename, fsync dir.

    A crash leaves either the old file or the new one at ``path``, never a mix.
    """
    temporary = path.with_name(f".tmp-{path.name}")
    temporary.unlink(missing_ok=True)
    record = write_durably(temporary, chunks)
    os.replace(temporary, path)
    fsync_dir(path.parent)
    return record


def read_verified(path: Path, expected: FileRecord | None, *, where: str) -> tuple[torch.Tensor, FileRecord]:
    """The bytes of ``path`` as a uint8 tensor, checked against ``expected`` when given.

    Raises :class:`CheckpointError` naming ``where`` if the file is missing, or
    its size or hash differs from ``expected``.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        msg = f"{where}: the file is missing"
        raise CheckpointError(msg) from None
    try:
        size = os.fstat(fd).st_size
        if expected is not None and size != expected.size:
            msg = (
                f"{where}: the file has {size} bytes but the manifest says {expected.size} "
                "(truncated or altered)"
            )
            raise CheckpointError(msg)
        # torch.empty, not bytearray: no zero-filling, and 64-byte aligned for tensor views.
        buffer = torch.empty(size, dtype=torch.uint8)
        view = buffer.numpy().data if size else memoryview(b"")
        hasher = _Hasher(threaded=size >= _THREAD_BYTES)
        offset = 0
        with open(fd, "rb", buffering=0, closefd=False) as handle:
            while offset < size:
                got = handle.readinto(view[offset : offset + _READ_CHUNK])
                if not got:
                    break
                hasher.update(view[offset : offset + got])
                offset += got
        digest = hasher.finish()
    finally:
        os.close(fd)
    if offset != size:
        msg = f"{where}: the file shrank while it was read ({offset} of {size} bytes)"
        raise CheckpointError(msg)
    if expected is not None and digest != expected.sha256:
        msg = f"{where}: the {HASH} checksum differs from the manifest's (the file is corrupted)"
        raise CheckpointError(msg)
    return buffer, FileRecord(size=size, sha256=digest)


def in_parallel(tasks: Sequence[Callable[[], T]]) -> list[T]:
    """Run file tasks on threads (I/O and hashing release the GIL); results in order.

    Every task finishes before this returns; the first failing task's error,
    in the order given, is raised.
    """
    if len(tasks) < 2:
        return [task() for task in tasks]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=len(tasks), thread_name_prefix="faccel-io") as pool:
        futures = [pool.submit(task) for task in tasks]
        return [future.result() for future in futures]


def check_written(directory: Path, records: Mapping[str, FileRecord], *, what: str) -> None:
    """Check that every file of ``records`` is still in ``directory``: a regular file of its size.

    Called on a written folder just before and just after its commit, so a
    folder emptied or changed under the writer (the root deleted, another
    process in the root) is reported, not committed. Sizes only: the hashes
    were computed from the bytes as they were written, and re-reading every
    file would double a checkpoint's I/O.

    Raises:
        CheckpointError: naming ``what``, the file and what differs.
    """
    for name, record in records.items():
        path = directory / name
        try:
            info = os.stat(path, follow_symlinks=False)
        except OSError as error:
            msg = (
                f"{what}: {path} is gone ({error.strerror}) after it was written: something else "
                "deletes or writes in this folder (the root removed during the write?); nothing was "
                "committed as complete"
            )
            raise CheckpointError(msg) from None
        if not stat.S_ISREG(info.st_mode) or info.st_size != record.size:
            msg = (
                f"{what}: {path} changed after it was written ({info.st_size} bytes, not "
                f"{record.size}): something else writes in this folder; nothing was committed as complete"
            )
            raise CheckpointError(msg)
