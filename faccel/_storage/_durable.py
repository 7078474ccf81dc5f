"""Durable files: written, hashed and fsynced; read back and checked against their hash.

The hash is computed from the bytes in memory while they are written, on a
second thread, so it overlaps the write and the fsync instead of re-reading
the file. Reading is the mirror: one ``readinto`` per chunk into a single
buffer, hashed chunk by chunk on a second thread. Two hashes, both 32 bytes:
BLAKE3, the default, which hashes about 5 GB/s on one core here (SHA-256:
1 GB/s, with the CPU's SHA instructions), so that a verified read costs
about what the read costs; and SHA-256, which the sharded format and the
whole-tensor format's version 1 record (see docs/checkpoints.md). A
:class:`FileRecord` names its hash, and a file is checked with the hash its
record names.

Every file faccel reads back (a checkpoint's files, ``load_model``'s weights
and index) is opened here, by :func:`open_regular`: a regular file only (a
FIFO, a device or a folder is refused without blocking), never through a
symbolic link out of its folder, and its real size checked against a cap
before a byte is allocated. JSON is parsed by :func:`parse_json`, which turns
every way hostile text can fail (too deep, too long a number) into one
:class:`CheckpointError` naming the file.

Large files are written through :class:`SyncedWriter`, which calls
``fdatasync`` on a helper thread after every 64 MiB: the disk starts early, in
step with the writing, and the dirty pages stay too few for the kernel to
throttle the writer, so the closing fsync has only the tail left. Pages made
durable are dropped from the page cache, so a checkpoint of any size holds
about 128 MiB of it while it is written.

POSIX durability needs three fsyncs: the file (its data), the directory that
holds it (its name), and, after a rename, the directory the name moved into.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import blake3
import torch

from faccel._storage._names import TMP
from faccel.errors import CheckpointError

__all__ = [
    "BLAKE3",
    "HASHES",
    "MAX_JSON",
    "MAX_MANIFEST",
    "SHA256",
    "FileRecord",
    "SyncedWriter",
    "allocatable_bytes",
    "atomic_write",
    "fsync_dir",
    "in_parallel",
    "new_hash",
    "open_regular",
    "parse_json",
    "read_json",
    "read_verified",
    "scratch_buffer",
    "write_durably",
]

T = TypeVar("T")
BLAKE3, SHA256 = "blake3", "sha256"
# The hashes a record may name: each makes a fresh object with update() and hexdigest().
HASHES: Mapping[str, Callable[[], Any]] = {BLAKE3: blake3.blake3, SHA256: hashlib.sha256}
# Below this many bytes a second thread costs more than it saves.
_THREAD_BYTES = 1 << 20
_READ_CHUNK = 64 << 20
# Written bytes between two early fdatasyncs (measured here: a 600 MB file is written and
# fsynced in about half the time of one write and one closing fsync).
_SYNC_BYTES = 64 << 20
# The largest JSON file read back: state, generators, a weights index (a few MB in practice).
# A thread's scratch: one hash block of the sharded format (4 MiB) and room to align it to pages.
_SCRATCH = (4 << 20) + 2 * 4096
MAX_JSON = 256 << 20
# A manifest lists about 100 bytes per rank: 32 MiB is room for 300,000 ranks.
MAX_MANIFEST = 32 << 20
# Digits of one JSON integer (Python's own limit for int(str)); 64-bit values need 20.
_MAX_DIGITS = 4300
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@attrs.frozen(kw_only=True)
class FileRecord:
    """A file's size in bytes and its digest (hex) under ``algorithm``, a key of :data:`HASHES`."""

    size: int
    digest: str
    algorithm: str = BLAKE3


def new_hash(algorithm: str) -> Any:
    """A fresh hash object of ``algorithm`` (a key of :data:`HASHES`), with ``update`` and ``hexdigest``.

    Example:
        >>> new_hash("sha256").hexdigest()[:16]
        'e3b0c44298fc1c14'
        >>> new_hash("blake3").hexdigest()[:16]
        'af1349b9f5f9a1a6'
    """
    return HASHES[algorithm]()


class _Hasher:
    """Hashes chunks in order on a background thread (hashlib and blake3 release the GIL)."""

    def __init__(self, threaded: bool, algorithm: str) -> None:
        self.hash = new_hash(algorithm)
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


class SyncedWriter:
    """Writes bytes to a new file, starting its writeback early; :meth:`close` fsyncs and closes it.

    After every ``_SYNC_BYTES`` written an ``fdatasync`` runs on a helper
    thread (one at a time; the writer never waits for it), so the disk works
    while the writer goes on. The pages it made durable are then dropped from
    the page cache: a checkpoint is read back rarely, and its gigabytes would
    otherwise push out the cache the training reads from (and count against a
    container's memory limit); new writes reuse the freed pages. A file
    smaller than ``_SYNC_BYTES`` stays cached. ``with SyncedWriter(path) as
    out:`` closes the descriptor on an error too, without the fsync.
    """

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._written = 0
        self._next_sync = _SYNC_BYTES
        self._syncing: threading.Thread | None = None
        self._error: OSError | None = None

    def __enter__(self) -> SyncedWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._wait()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _sync(self, upto: int) -> None:
        try:
            os.fdatasync(self.fd)
            _drop_cached(self.fd, upto)
        except OSError as error:  # raised by close()
            self._error = error

    def _wait(self) -> None:
        if self._syncing is not None:
            self._syncing.join()
            self._syncing = None

    def write(self, chunk: Any) -> None:
        """Append ``chunk`` (bytes-like) to the file."""
        view = memoryview(chunk).cast("B")
        offset = 0
        while offset < len(view):
            done = os.write(self.fd, view[offset : offset + self._next_sync - self._written])
            offset += done
            self._written += done
            if self._written >= self._next_sync:
                self._next_sync = self._written + _SYNC_BYTES
                if self._syncing is None or not self._syncing.is_alive():
                    upto = self._written
                    self._syncing = threading.Thread(
                        target=self._sync, args=(upto,), name="faccel-sync", daemon=True
                    )
                    self._syncing.start()

    def close(self) -> int:
        """fsync the file (data and size), close it and return its size in bytes."""
        self._wait()
        if self._error is not None:
            raise self._error
        os.fsync(self.fd)
        size = os.fstat(self.fd).st_size
        if size >= _SYNC_BYTES:
            _drop_cached(self.fd, size)
        os.close(self.fd)
        self.fd = -1
        return size


def _drop_cached(fd: int, upto: int) -> None:
    """Drop the file's first ``upto`` bytes from the page cache (they are durable: clean pages).

    Advice only: where it is missing (macOS) or refused, the pages stay cached and nothing else changes.
    """
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, upto, os.POSIX_FADV_DONTNEED)


def write_durably(path: Path, chunks: Sequence[Any], *, algorithm: str = BLAKE3) -> FileRecord:
    """Write ``chunks`` (bytes-like) to a new file at ``path``, fsync it, return its record.

    The record's digest is of ``algorithm``. The caller fsyncs the directory (once for many files).
    """
    views = [memoryview(chunk).cast("B") for chunk in chunks]
    size = sum(len(view) for view in views)
    hasher = _Hasher(size >= _THREAD_BYTES, algorithm)
    try:
        with SyncedWriter(path) as out:
            for view in views:
                hasher.update(view)
                out.write(view)
            out.close()
    finally:
        digest = hasher.finish()
    return FileRecord(size=size, digest=digest, algorithm=algorithm)


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
    temporary = path.with_name(TMP + path.name)
    temporary.unlink(missing_ok=True)
    record = write_durably(temporary, chunks)
    os.replace(temporary, path)
    fsync_dir(path.parent)
    return record


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: Path, *, where: str, within: Sequence[Path] = ()) -> int:
    """A descriptor open for reading on the regular file at ``path`` (the caller closes it).

    Never blocks (a FIFO is opened non-blocking, then refused) and never reads
    a folder, a device or a socket. Symbolic links: with ``within`` empty,
    ``path`` and the folder holding it must not be links (a checkpoint holds
    none); otherwise links are followed only while the real path stays inside
    one of the ``within`` folders (given as real paths). Raises
    :class:`CheckpointError` naming ``where``.
    """
    try:
        if within:
            real = Path(os.path.realpath(path))
            if not any(real.is_relative_to(root) for root in within):
                msg = (
                    f"{where}: a symbolic link to {real}, outside {within[0]}; faccel reads only the "
                    "files inside the folder it is given"
                )
                raise CheckpointError(msg)
            fd = os.open(real, _READ_FLAGS)
        else:
            folder = os.open(path.parent, _DIR_FLAGS)
            try:
                fd = os.open(path.name, _READ_FLAGS, dir_fd=folder)
            finally:
                os.close(folder)
    except FileNotFoundError:
        msg = f"{where}: the file is missing"
        raise CheckpointError(msg) from None
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.ENOTDIR):
            msg = (
                f"{where}: it or its folder is a symbolic link (or not a folder); a checkpoint's "
                "folder and files are never links, and faccel does not follow them"
            )
        else:
            msg = f"{where}: cannot be opened ({error.strerror})"
        raise CheckpointError(msg) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        msg = f"{where}: {_kind(mode)}, not a regular file; faccel reads regular files only"
        raise CheckpointError(msg)
    return fd


def _check_size(size: int, expected: FileRecord | None, limit: int | None, where: str) -> None:
    if expected is not None and size != expected.size:
        msg = (
            f"{where}: the file has {size} bytes but the manifest says {expected.size} (truncated or altered)"
        )
        raise CheckpointError(msg)
    if limit is not None and size > limit:
        msg = (
            f"{where}: the file has {size} bytes, more than the {limit} such a file may have here: "
            "a corrupt or forged file, or objects other than those that wrote it"
        )
        raise CheckpointError(msg)


def read_verified(
    path: Path,
    expected: FileRecord | None,
    *,
    where: str,
    limit: int | None = None,
    within: Sequence[Path] = (),
    algorithm: str = BLAKE3,
) -> tuple[torch.Tensor, FileRecord]:
    """The bytes of ``path`` as a uint8 tensor, checked against ``expected`` when given.

    The file is opened by :func:`open_regular` (``within`` as there), and its
    size checked against ``expected`` and ``limit`` before anything is
    allocated. It is hashed with ``expected``'s algorithm, or ``algorithm``
    when there is no record; the record returned names that hash. Raises
    :class:`CheckpointError` naming ``where`` if the file is missing, not a
    regular file, a link refused, too large, or its size or hash differs
    from ``expected``.
    """
    fd = open_regular(path, where=where, within=within)
    try:
        size = os.fstat(fd).st_size
        _check_size(size, expected, limit, where)
        # torch.empty, not bytearray: no zero-filling, and 64-byte aligned for tensor views.
        buffer = torch.empty(size, dtype=torch.uint8)
        view = buffer.numpy().data if size else memoryview(b"")
        if expected is not None:
            algorithm = expected.algorithm
        hasher = _Hasher(size >= _THREAD_BYTES, algorithm)
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
    if expected is not None and digest != expected.digest:
        msg = f"{where}: the {algorithm} checksum differs from the manifest's (the file is corrupted)"
        raise CheckpointError(msg)
    return buffer, FileRecord(size=size, digest=digest, algorithm=algorithm)


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_DIGITS:
        msg = f"an integer of {len(text)} digits"
        raise ValueError(msg)
    return int(text)


def parse_json(data: bytes | memoryview, where: str) -> Any:
    """``data`` parsed as JSON, or one :class:`CheckpointError` naming ``where``.

    Whatever hostile text makes the parser raise (bad UTF-8 or syntax, nesting
    deeper than the interpreter's recursion limit, an integer of thousands of
    digits) is caught here and nowhere else.

    Example:
        >>> parse_json(b'{"a": [1, 2.5]}', "x.json")
        {'a': [1, 2.5]}
        >>> parse_json(b"[" * 100_000, "x.json")
        Traceback (most recent call last):
        ...
        faccel.errors.CheckpointError: x.json: not JSON (RecursionError...)
    """
    try:
        return json.loads(bytes(data), parse_int=_parse_int)
    except (ValueError, RecursionError, TypeError, OverflowError) as error:
        msg = f"{where}: not JSON ({type(error).__name__}: {str(error)[:120]})"
        raise CheckpointError(msg) from None


def read_json(path: Path, *, where: str, limit: int = MAX_JSON, within: Sequence[Path] = ()) -> Any:
    """The JSON file at ``path``: opened and size-capped as :func:`read_verified`, parsed by
    :func:`parse_json`. Raises :class:`CheckpointError` naming ``where``."""
    buffer, _ = read_verified(path, None, where=where, limit=limit, within=within)
    return parse_json(buffer.numpy().data, where)


def scratch_buffer(scratch: dict[str, Any], kind: str, size: int) -> Any:
    """This thread's scratch buffer of ``kind``, grown to at least ``size`` bytes (page-aligned)."""
    import mmap

    import numpy as np

    if kind not in scratch or len(scratch[kind]) < size:
        scratch[kind] = np.frombuffer(mmap.mmap(-1, max(size, _SCRATCH)), dtype=np.uint8)
    return scratch[kind]


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


def allocatable_bytes() -> int | None:
    """What this process can still allocate: ``MemAvailable``, capped by ``RLIMIT_AS``; None if unknown."""
    import resource

    room = None
    try:
        with open("/proc/meminfo", "rb") as info:
            for line in info:
                if line.startswith(b"MemAvailable:"):
                    room = int(line.split()[1]) * 1024
        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/statm", "rb") as statm:
                mapped = int(statm.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
            room = min(room if room is not None else soft, max(0, soft - mapped))
    except (OSError, ValueError, IndexError):
        return room
    return room
