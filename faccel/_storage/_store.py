"""The storage seam: what checkpoints and saved models need from a place that holds bytes.

A :class:`Store` holds files under keys (``/``-separated; a key's folders are
the keys before its last ``/``). Checkpoints and saved models call only this
protocol, never ``os`` or ``shutil``: the local disk (``_local``) is the first
implementation, object storage through fsspec (``_objects``) the second.

The commit is expressed so that a store without rename can implement it: a
checkpoint's files are written first, into :meth:`Store.staging` (on a disk a
hidden sibling folder, on an object store the final prefix itself), and the
manifest (every file's size and digest) last, by :meth:`Store.commit`. On a
disk the commit renames the folder into place; on an object store the
manifest's write is the commit. Either way, a folder without a manifest is
invisible to readers and removable by the next writer that holds the root's
lock (:meth:`Store.lock`).

:class:`Spot` names one place (a store and a key) and joins like a path, so
that the code above reads ``directory / MANIFEST`` on any store; its ``str`` is
the local path, or the URL without credentials.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch

from faccel._storage._durable import BLAKE3, FileRecord

__all__ = ["Entry", "Lease", "Reader", "Spot", "Store", "Writer"]


@attrs.frozen(kw_only=True)
class Entry:
    """One name directly inside a folder: a file (with its size) or a folder (``size`` None)."""

    name: str
    folder: bool
    size: int | None = None


@attrs.frozen(kw_only=True)
class Lease:
    """A held writer lock on a root: the key of its lock object and what identifies this holder."""

    key: str
    token: str
    handle: Any = attrs.field(default=None, eq=False, repr=False)


class Reader(Protocol):
    """An open file, read by byte ranges (each read bounded by :attr:`size`, the store's own)."""

    size: int

    def read_into(self, target: Any, offset: int) -> None:
        """Fill ``target`` (a writable bytes-like view) with the bytes at ``offset``; raises
        :class:`~faccel.errors.CheckpointError` when the file ends sooner."""

    def direct(self, offset: int, need: int, scratch: dict[str, Any]) -> Any:
        """``need`` bytes at ``offset`` read around the page cache into ``scratch``, or None where
        this store has no such read (then :meth:`read_into` is used)."""

    def close(self) -> None:
        """Release the file."""


class Writer(Protocol):
    """A new file written in order; :meth:`close` makes it durable and returns its size."""

    def write(self, chunk: Any) -> None:
        """Append ``chunk`` (bytes-like)."""

    def patch_head(self, data: bytes) -> None:
        """Overwrite the first ``len(data)`` bytes written (a header completed after its data)."""

    def close(self) -> int:
        """Make the file durable and return its size (on error, leave with ``__exit__``)."""

    def __enter__(self) -> Writer: ...

    def __exit__(self, *exc: object) -> None: ...


class Store(Protocol):
    """Durable write, commit, list, ranged read, delete, lock: all that faccel asks of storage."""

    @property
    def local(self) -> bool:
        """Whether keys are paths of this machine's file system."""

    # True where a folder appears by one rename once whole (a disk): one without a manifest was
    # damaged after its commit. False where the manifest's write is the commit (an object store):
    # one without a manifest is a write not (yet) committed, invisible, not damaged.
    @property
    def renames(self) -> bool: ...

    def display(self, key: str) -> str:
        """``key`` as a user reads it: a path, or a URL without credentials."""

    def join(self, key: str, name: str) -> str:
        """The key of ``name`` inside folder ``key``."""

    def parent(self, key: str) -> str:
        """The key of the folder that holds ``key``."""

    def canonical(self, key: str) -> str:
        """One name per place (a local path made absolute), to tell whether two roots are one."""

    def list(self, key: str) -> list[Entry]:
        """The names directly inside folder ``key`` (none when it is missing or not a folder)."""

    def size(self, key: str) -> int | None:
        """The size of the file at ``key`` by the store's own account, or None when it is absent
        (or not a regular file)."""

    def is_folder(self, key: str) -> bool:
        """Whether ``key`` is a folder (on an object store: a prefix that holds objects)."""

    def blocking_file(self, key: str) -> str | None:
        """``key`` or its first existing ancestor when that one is a file (no folder can be made)."""

    def make_folder(self, key: str) -> None:
        """Create folder ``key`` and its parents (nothing to do where folders are prefixes)."""

    def exists(self, key: str) -> bool:
        """Whether anything is at ``key``: a file, a folder (a prefix holding objects), or on a disk
        a name of any kind (a dangling link too: what a reader that refuses links reports)."""

    def resolve(self, key: str) -> str:
        """Where ``key``'s files really are: on a disk every symbolic link resolved; the key itself
        where there are no links."""

    def occupied(self, key: str) -> int:
        """The bytes the files directly in folder ``key`` hold: on a disk the allocated blocks (a
        file with holes counts what it stores, not its size); on an object store their sizes."""

    def folder_visible(self, key: str) -> bool:
        """Whether a folder made at ``key`` by another process is seen here (a shared file system);
        always where folders are the prefixes of keys (nothing to see before objects are in it)."""

    def write(self, key: str, chunks: Sequence[Any], *, algorithm: str = BLAKE3) -> FileRecord:
        """Write a new file durably, hashed as written; its record."""

    def writer(self, key: str) -> Writer:
        """A :class:`Writer` for a new file at ``key``."""

    def publisher(self, key: str) -> Writer:
        """A :class:`Writer` whose file appears at ``key`` whole, when it is closed, or not at all
        (on a disk: written beside it and renamed; :meth:`sync_folder` then makes the name durable)."""

    def sync_folder(self, key: str) -> None:
        """Make the names in folder ``key`` durable (creations, renames, deletions); nothing to do
        where an object is durable once written."""

    def replace(self, key: str, chunks: Sequence[Any]) -> FileRecord:
        """Replace the file at ``key`` atomically (the old bytes or the new, never a mix)."""

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
        """A whole file, its size checked (against ``expected`` and ``limit``) before a byte is
        allocated, its hash against ``expected``; ``within``: the folders a symbolic link may lead
        into (none by default; a store without links has nothing to follow)."""

    def open(self, key: str, *, where: str) -> Reader:
        """The file at ``key`` open for ranged reads."""

    def delete(self, key: str) -> None:
        """Remove the file or folder ``key`` with everything in it (absent: nothing to do)."""

    def staging(self, final: str) -> str:
        """Where the files of the folder committed as ``final`` are written before the commit."""

    def commit(
        self,
        staging: str,
        final: str,
        manifest_name: str,
        manifest: Sequence[Any],
        *,
        check: Callable[[str, bool], None],
    ) -> FileRecord:
        """Write ``manifest`` last and make ``staging`` visible as ``final``: the commit.

        ``check(folder, committed)`` is called on the written folder before the
        commit and on the committed one after it (sizes of the files against
        their records, the lock); ``committed`` says whether a failure leaves the
        checkpoint committed all the same (the manifest written, nothing renamed back).
        A committed ``final`` that exists already is replaced, and a crash leaves
        the old or the new one (where the store cannot promise that, it refuses).
        """

    def retire(self, folder: str, *, committed: bool) -> None:
        """Delete a checkpoint folder, invisible to readers first (its manifest goes first)."""

    def move(self, folder: str, target: str) -> None:
        """Move the committed checkpoint folder ``folder`` to ``target`` (a rollback sets later ones aside):
        on a disk one rename, so a crash leaves it at one place or the other."""

    def leftovers(self, root: str, *, counts: Callable[[str], bool]) -> None:
        """Remove what dead writers left under ``root`` (the caller holds its lock):
        ``counts(folder)`` says whether a folder is a committed checkpoint, never removed."""

    def lock(self, root: str) -> contextlib.AbstractContextManager[Lease]:
        """Hold ``root``'s writer lock for a ``with`` block; a second writer is refused at once."""

    def check_lock(self, lease: Lease) -> str | None:
        """None while ``lease`` still holds its root, else what happened to it."""


@attrs.frozen
class Spot:
    """A place in a store: ``directory / name`` joins, ``str`` shows it (a path, or a credential-free URL)."""

    store: Store = attrs.field(eq=False, repr=False)
    key: str

    def __truediv__(self, name: str) -> Spot:
        return Spot(self.store, self.store.join(self.key, name))

    @property
    def name(self) -> str:
        return self.key.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Spot:
        return Spot(self.store, self.store.parent(self.key))

    def __str__(self) -> str:
        return self.store.display(self.key)

    def entries(self) -> Iterator[Entry]:
        """The names directly inside this folder."""
        return iter(self.store.list(self.key))

    def write(self, chunks: Sequence[Any], *, algorithm: str = BLAKE3) -> FileRecord:
        """A new file here, written durably (:meth:`Store.write`)."""
        return self.store.write(self.key, chunks, algorithm=algorithm)

    def read(
        self, expected: FileRecord | None, *, where: str, limit: int | None = None, algorithm: str = BLAKE3
    ) -> tuple[torch.Tensor, FileRecord]:
        """This whole file, checked (:meth:`Store.read`)."""
        return self.store.read(self.key, expected, where=where, limit=limit, algorithm=algorithm)

    def size(self) -> int | None:
        """This file's size by the store's account, or None when absent."""
        return self.store.size(self.key)

    def sizes(self) -> Mapping[str, int]:
        """The files directly inside this folder and their sizes."""
        return {e.name: e.size for e in self.store.list(self.key) if not e.folder and e.size is not None}
