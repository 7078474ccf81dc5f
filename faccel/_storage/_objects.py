"""Object storage as a :class:`~faccel._storage._store.Store`, through fsspec (``s3://``, ``gs://``, ``memory://``).

An object store has no rename and no fsync: an object is whole once its
upload returns, and only the manifest's write commits a checkpoint. So the
files of a checkpoint are uploaded straight under their final prefix
(``Store.staging`` is the final key), and :meth:`ObjectStore.commit` writes
the manifest last, with a conditional write where the store has one
(``If-None-Match: *`` on S3: of two writers of one step, the second's commit
fails and it gets the named error). A prefix without a manifest is invisible
to readers and removed by the next checkpoint into the root (its writer holds
the root's lease, so every such prefix is a dead writer's).

One writer per root: a lease object ``ROOT/.lock`` (JSON: host, pid, a random
token, when it was last renewed), created with a conditional write and renewed
by a thread while it is held. A second writer is refused at once, naming the
holder; a lease whose holder is a dead process of this host, or that was not
renewed for :data:`LEASE_SECONDS`, is broken and taken over by the one writer
whose conditional write of its break object (``ROOT/.lock-broken-DIGEST-N``) wins
(a breaker that dies in turn is seen dead by its break object, and the next
writer claims generation ``N + 1``);
a lease that vanished is created anew, never deleted: a live writer's lease is
never taken over.

Every call is retried on a transient error (throttling, a 5xx answer, a
reset connection: what fsspec raises as a plain ``OSError`` or a timeout; never
a 4xx answer but 408 and 429), a
bounded number of times with exponential backoff, and then raised as a
:class:`~faccel.errors.CheckpointError` naming the object (never the
credentials: keys are shown as ``protocol://bucket/key``, and options are
never printed). Reads are bounded by the object's size as the store reports
it, checked before a byte is allocated.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch

from faccel._storage._durable import BLAKE3, FileRecord, new_hash
from faccel._storage._names import LEASE_BREAK, LOCK, MANIFEST
from faccel._storage._store import Entry, Lease, Spot
from faccel.errors import ArgumentValueError, CheckpointError, MissingExtraError

__all__ = ["ATTEMPTS", "LEASE_SECONDS", "ObjectStore", "object_spot"]

T = TypeVar("T")
# Which extra provides each protocol (the message of a missing one names it).
_EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}
# Tries of one call before a transient error is raised, and the first wait (doubled each time).
ATTEMPTS = 6
_FIRST_WAIT = 0.05
# Breakers of one dead lease that may die in turn before one finishes (each generation one claim).
_BREAK_GENERATIONS = 64
# A lease not renewed for this long is a dead writer's (renewed every third of it while held).
LEASE_SECONDS = 60.0
# Bytes of one ranged GET of a whole-file read (the buffer is filled in these steps).
_READ_STEP = 64 << 20
_CREDENTIALS = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@")


def _safe(url: str) -> str:
    """``url`` without a ``user:secret@`` part."""
    return _CREDENTIALS.sub(r"\1", url)


def object_spot(url: str) -> Spot:
    """The object store of ``url``'s protocol and the key of ``url`` in it.

    Options (endpoint, credentials) come from where fsspec and the protocol's
    library read them: the standard environment variables (``AWS_*``,
    ``GOOGLE_APPLICATION_CREDENTIALS``) and fsspec's configuration.

    Raises:
        MissingExtraError: The protocol's package is not installed (the extra to install is named).
    """
    protocol = url.split("://", 1)[0].lower()
    if _CREDENTIALS.match(url):
        msg = (
            f"{_safe(url)}: a URL with credentials in it ('user:secret@'); faccel never reads "
            "credentials from a path (they would show in logs and errors): set them in the standard "
            "environment variables or fsspec's configuration (docs/object-storage.md)"
        )
        raise ArgumentValueError(msg)
    extra = _EXTRAS.get(protocol)
    install = f"pip install 'faccel[{extra}]'" if extra else "install the fsspec package for it"
    try:
        import fsspec
        from fsspec.core import url_to_fs

        fs, key = url_to_fs(url)
    except ImportError as error:
        msg = (
            f"{_safe(url)}: a {protocol}:// root needs the optional extra that provides it "
            f"({getattr(error, 'name', None) or 'fsspec'} is not installed); {install}"
        )
        raise MissingExtraError(msg) from None
    except ValueError as error:  # an unknown protocol
        msg = f"{_safe(url)}: fsspec knows no storage for {protocol}:// ({error}); {install}"
        raise MissingExtraError(msg) from None
    del fsspec
    return Spot(ObjectStore(fs, protocol), key.rstrip("/"))


def _status(error: BaseException) -> int | None:
    """The HTTP status of the answer behind ``error`` (s3fs keeps botocore's error as the cause)."""
    seen: BaseException | None = error
    for _ in range(8):  # a short chain: the translated error, its cause, theirs
        if seen is None:
            return None
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(status, int):
                return status
        seen = seen.__cause__ or seen.__context__
    return None


def _transient(error: BaseException) -> bool:
    """Whether ``error`` may pass on its own (throttling, 5xx, a reset or timed-out connection); a 4xx
    answer other than 408 and 429 (a bad request, a denied one) never passes by waiting."""
    if isinstance(error, (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)):
        return False
    status = _status(error)
    if status is not None and 400 <= status < 500:
        return status in (408, 429)
    if isinstance(error, (ConnectionError, TimeoutError)):
        return True
    if isinstance(error, OSError):
        return True  # s3fs and gcsfs raise a 5xx, SlowDown or a dropped connection as a plain OSError
    name = type(error).__name__
    return any(word in name for word in ("Timeout", "Connection", "Throttl", "ServerError"))


class ObjectStore:
    """Keys are ``bucket/path`` as fsspec names them; the filesystem object holds the options."""

    local = False
    renames = False

    def __init__(self, fs: Any, protocol: str) -> None:
        self.fs = fs
        self.protocol = protocol
        self.exclusive = True  # conditional writes (mode="create"); cleared where the store refuses them

    def __repr__(self) -> str:  # never the filesystem's options (they may hold credentials)
        return f"ObjectStore({self.protocol}://)"

    def display(self, key: str) -> str:
        return f"{self.protocol}://{key}"

    def join(self, key: str, name: str) -> str:
        return f"{key.rstrip('/')}/{name}"

    def parent(self, key: str) -> str:
        return key.rstrip("/").rsplit("/", 1)[0]

    def canonical(self, key: str) -> str:
        return self.display(key.rstrip("/"))

    def _call(self, what: str, key: str, call: Callable[[], T]) -> T:
        """``call()``, retried on transient errors with backoff, then a named CheckpointError."""
        wait = _FIRST_WAIT
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return call()
            except (FileNotFoundError, FileExistsError, NotImplementedError, TypeError):
                raise  # answers the callers handle (absent, taken, no conditional writes)
            except CheckpointError:
                raise
            except Exception as error:
                if not _transient(error) or isinstance(error, PermissionError):
                    status = _status(error)
                    answer = f"HTTP {status}, " if status is not None else ""
                    msg = (
                        f"{self.display(key)}: {what} was refused ({answer}{type(error).__name__}: "
                        f"{_safe(str(error))[:200]}); not retried, as waiting does not change such an "
                        "answer: check the URL, the bucket and the credentials (standard environment "
                        "variables or fsspec's configuration)"
                    )
                    raise CheckpointError(msg) from None
                if attempt == ATTEMPTS:
                    msg = (
                        f"{self.display(key)}: {what} failed {ATTEMPTS} times with a transient error "
                        f"({type(error).__name__}: {_safe(str(error))[:200]}); the store is unavailable "
                        "or throttling: nothing was committed, retry later"
                    )
                    raise CheckpointError(msg) from None
                time.sleep(wait)
                wait = min(wait * 2, 2.0)
        raise AssertionError  # pragma: no cover - the loop returns or raises

    def list(self, key: str) -> list[Entry]:
        def ls() -> list[dict[str, Any]]:
            self.fs.invalidate_cache(key)  # another process may have written since the last listing
            try:
                return list(self.fs.ls(key, detail=True))
            except (FileNotFoundError, NotADirectoryError):
                return []

        found = []
        for info in self._call("listing", key, ls):
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            if info.get("type") == "directory":
                found.append(Entry(name=name, folder=True))
            else:
                found.append(Entry(name=name, folder=False, size=int(info.get("size") or 0)))
        return found

    def _info(self, key: str) -> dict[str, Any] | None:
        def info() -> dict[str, Any] | None:
            try:
                self.fs.invalidate_cache(self.parent(key))
                return dict(self.fs.info(key))
            except FileNotFoundError:
                return None

        return self._call("reading the size of", key, info)

    def size(self, key: str) -> int | None:
        info = self._info(key)
        if info is None or info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def is_folder(self, key: str) -> bool:
        return any(True for _ in self.list(key))

    def blocking_file(self, key: str) -> str | None:
        return self.display(key) if self.size(key) is not None else None

    def make_folder(self, key: str) -> None:
        """Nothing to make: an object store's folders are the prefixes of its keys."""

    def exists(self, key: str) -> bool:
        return self._info(key) is not None or self.is_folder(key)

    def resolve(self, key: str) -> str:
        return key  # no links

    def occupied(self, key: str) -> int:
        return sum(entry.size or 0 for entry in self.list(key) if not entry.folder)

    def folder_visible(self, key: str) -> bool:
        return True  # a prefix: nothing to see before objects are in it, and nothing to make

    def write(self, key: str, chunks: Sequence[Any], *, algorithm: str = BLAKE3) -> FileRecord:
        views = [memoryview(chunk).cast("B") for chunk in chunks]
        hasher = new_hash(algorithm)
        for view in views:
            hasher.update(view)
        size = sum(len(view) for view in views)
        self._upload(key, views)
        return FileRecord(size=size, digest=hasher.hexdigest(), algorithm=algorithm)

    def _upload(self, key: str, views: Sequence[memoryview], *, create: bool = False) -> None:
        def put() -> None:
            if create or sum(len(v) for v in views) < (32 << 20):
                data = b"".join(views)
                self.fs.pipe_file(key, data, **({"mode": "create"} if create else {}))
                return
            with self.fs.open(key, "wb") as out:  # a multipart upload, part by part
                for view in views:
                    out.write(view)

        self._call("uploading", key, put)

    def writer(self, key: str) -> _ObjectWriter:
        return _ObjectWriter(self, key)

    def publisher(self, key: str) -> _ObjectWriter:
        """An object appears whole when its upload ends: the writer is already atomic."""
        return _ObjectWriter(self, key)

    def sync_folder(self, key: str) -> None:
        """Nothing to do: an uploaded object is durable."""

    def replace(self, key: str, chunks: Sequence[Any]) -> FileRecord:
        """One object's upload is atomic: readers see the old object or the new one."""
        return self.write(key, chunks)

    def read(
        self,
        key: str,
        expected: FileRecord | None,
        *,
        where: str,
        limit: int | None = None,
        algorithm: str = BLAKE3,
        within: Sequence[str | os.PathLike[str]] = (),  # no links to follow
    ) -> tuple[torch.Tensor, FileRecord]:
        if expected is None and limit is not None:
            return self._read_small(key, where=where, limit=limit, algorithm=algorithm)
        reader = self.open(key, where=where)
        size = reader.size
        if expected is not None and size != expected.size:
            msg = (
                f"{where}: the object has {size} bytes but the manifest says {expected.size} "
                "(truncated or altered)"
            )
            raise CheckpointError(msg)
        if limit is not None and size > limit:
            msg = (
                f"{where}: the object has {size} bytes, more than the {limit} such a file may have here: "
                "a corrupt or forged object"
            )
            raise CheckpointError(msg)
        buffer = torch.empty(size, dtype=torch.uint8)
        view = buffer.numpy().data if size else memoryview(b"")
        if expected is not None:
            algorithm = expected.algorithm
        hasher = new_hash(algorithm)
        for offset in range(0, size, _READ_STEP):
            part = view[offset : offset + _READ_STEP]
            reader.read_into(part, offset)
            hasher.update(part)
        digest = hasher.hexdigest()
        if expected is not None and digest != expected.digest:
            msg = f"{where}: the {algorithm} checksum differs from the manifest's (the object is corrupted)"
            raise CheckpointError(msg)
        return buffer, FileRecord(size=size, digest=digest, algorithm=algorithm)

    def _read_small(
        self, key: str, *, where: str, limit: int, algorithm: str
    ) -> tuple[torch.Tensor, FileRecord]:
        """A file with no record yet (a manifest, a lease, an index): one ranged GET of at most
        ``limit + 1`` bytes, so that a larger object is refused without being read whole."""

        def get() -> bytes:
            return bytes(self.fs.cat_file(key, start=0, end=limit + 1))

        try:
            data = self._call("reading", key, get)
        except FileNotFoundError:
            msg = f"{where}: the file is missing"
            raise CheckpointError(msg) from None
        if len(data) > limit:
            msg = (
                f"{where}: the object has more than the {limit} bytes such a file may have here: "
                "a corrupt or forged object"
            )
            raise CheckpointError(msg)
        hasher = new_hash(algorithm)
        hasher.update(data)
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data
            else torch.empty(0, dtype=torch.uint8)
        )
        return buffer, FileRecord(size=len(data), digest=hasher.hexdigest(), algorithm=algorithm)

    def open(self, key: str, *, where: str) -> _ObjectReader:
        info = self._info(key)
        if info is None:
            msg = f"{where}: the file is missing"
            raise CheckpointError(msg)
        if info.get("type") == "directory":
            msg = f"{where}: a folder, not a file; faccel reads files only"
            raise CheckpointError(msg)
        return _ObjectReader(self, key, int(info.get("size") or 0), where)

    def delete(self, key: str) -> None:
        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(key, recursive=True)
            self.fs.invalidate_cache(self.parent(key))

        self._call("deleting", key, rm)

    def staging(self, final: str) -> str:
        return final  # no rename: the files go to their final keys, the manifest commits them

    def commit(
        self,
        staging: str,
        final: str,
        manifest_name: str,
        manifest: Sequence[Any],
        *,
        check: Callable[[str, bool], None],
    ) -> FileRecord:
        check(final, False)
        key = self.join(final, manifest_name)
        views = [memoryview(chunk).cast("B") for chunk in manifest]
        hasher = new_hash(BLAKE3)
        for view in views:
            hasher.update(view)
        try:
            self._upload(key, views, create=self.exclusive)
        except FileExistsError:
            msg = (
                f"{self.display(final)}: another writer committed this checkpoint first (its manifest "
                "appeared while this one was written): one writer per checkpoint root; nothing of this "
                "write was committed"
            )
            raise CheckpointError(msg) from None
        except (NotImplementedError, TypeError):  # a store without conditional writes: the lease guards
            self.exclusive = False
            self._upload(key, views)
        check(final, True)  # the manifest is there: committed, whatever this finds
        return FileRecord(size=sum(len(v) for v in views), digest=hasher.hexdigest(), algorithm=BLAKE3)

    def retire(self, folder: str, *, committed: bool) -> None:
        """The manifest first: the checkpoint is invisible from then on, whatever is left of it."""
        if committed:
            self.delete(self.join(folder, MANIFEST))
        self.delete(folder)

    def move(self, folder: str, target: str) -> None:
        """No rename on an object store: a copy, then the original retired (its manifest first), so a
        crash leaves the checkpoint at its place, or at both."""

        def copy() -> None:
            self.fs.copy(folder, target, recursive=True)
            self.fs.invalidate_cache(self.parent(target))

        self._call("moving", folder, copy)
        self.retire(folder, committed=True)

    def leftovers(self, root: str, *, counts: Callable[[str], bool]) -> None:
        """Nothing here: an uncommitted checkpoint is a step prefix without a manifest, which the
        caller recognises and deletes (``_checkpoint/_folders.remove_leftovers``); the break
        objects of a dead lease go when its breaker's own lease stands (``_acquire``)."""

    @contextlib.contextmanager
    def lock(self, root: str) -> Iterator[Lease]:
        key = self.join(root, LOCK)
        token = secrets.token_hex(16)
        self._acquire(key, token, root)
        stop = threading.Event()
        renewer = threading.Thread(
            target=self._renew, args=(key, token, stop), name="faccel-lease", daemon=True
        )
        renewer.start()
        try:
            yield Lease(key=key, token=token)
        finally:
            stop.set()
            renewer.join()
            with contextlib.suppress(Exception):  # the root may be gone: nothing to tidy
                if self._holder(key).get("token") == token:
                    self.fs.rm_file(key)  # one object: one request

    def _lease_bytes(self, token: str) -> bytes:
        lease = {"host": socket.gethostname(), "pid": os.getpid(), "token": token, "renewed": time.time()}
        return json.dumps(lease).encode()

    def _lease_raw(self, key: str) -> bytes:
        def cat() -> bytes:
            try:
                self.fs.invalidate_cache(self.parent(key))
                return bytes(self.fs.cat_file(key, start=0, end=4096))
            except FileNotFoundError:
                return b""

        return self._call("reading the lease", key, cat)

    def _holder(self, key: str) -> dict[str, Any]:
        return _parse_lease(self._lease_raw(key))

    def _acquire(self, key: str, token: str, root: str) -> None:
        """Create the lease; a live holder's is never touched: a lease that vanished is created anew
        (its holder released it), and a dead holder's is broken only by the one writer that wins the
        conditional creation of its break object (two that saw one dead lease never both break it,
        so neither deletes the lease the other has just taken). Once this writer's lease stands, the
        break objects it won its way through are deleted: a contender that claims one again re-reads
        the lease, finds it live, and is refused."""
        claims: list[str] = []  # the break objects of the dead leases this writer broke
        for _ in range(6):
            try:
                self._upload(key, [memoryview(self._lease_bytes(token))], create=self.exclusive)
                for claim in claims:
                    self.delete(claim)
                return
            except FileExistsError:
                pass
            except (NotImplementedError, TypeError):
                self.exclusive = False
                if not self._holder(key):
                    self._upload(key, [memoryview(self._lease_bytes(token))])
                    return
            raw = self._lease_raw(key)
            if not raw:
                continue  # released since: try to create it again
            holder = _parse_lease(raw)
            if holder and not _stale(holder):
                msg = (
                    f"{self.display(root)}: another process is writing a checkpoint into this root "
                    f"(host {holder.get('host')}, pid {holder.get('pid')}, holds {self.display(key)}): one "
                    "writer per checkpoint root. Give each run its own root, or stop the other run first "
                    f"(a lease not renewed for {LEASE_SECONDS:.0f} s is taken over)"
                )
                raise CheckpointError(msg)
            if self.exclusive:
                won = self._claim_break(root, raw, token)
                if not won:
                    continue  # another writer breaks this dead lease: see what it holds next
                claims.extend(won)
                if self._lease_raw(key) != raw:
                    continue  # not the lease judged dead any more
            self.delete(key)  # a dead writer's lease
        msg = f"{self.display(key)}: the lease could not be taken (other writers keep taking it)"
        raise CheckpointError(msg)

    def _claim_break(self, root: str, raw: bytes, token: str) -> Sequence[str]:
        """The break objects of the dead lease ``raw`` up to the one this writer won (empty if it
        lost): the right to break it is the conditional creation of a break object named by the
        lease's digest and a generation.

        The break object is lease-shaped (this host, this pid, the time), so a breaker that died
        before it deleted the dead lease is itself seen dead, and the next generation is claimed
        instead: one dead breaker never locks the root for good. A live breaker's claim stands.
        """
        seen = new_hash(BLAKE3)
        seen.update(raw)
        digest = seen.hexdigest()[:32]
        marks = [self.join(root, f"{LEASE_BREAK}{digest}-{n}") for n in range(_BREAK_GENERATIONS)]
        for generation, mark in enumerate(marks):
            try:
                self._upload(mark, [memoryview(self._lease_bytes(token))], create=True)
                return marks[: generation + 1]
            except FileExistsError:
                breaker = self._holder(mark)
                if breaker and not _stale(breaker):
                    return []  # a live writer is breaking it
        return []

    def _renew(self, key: str, token: str, stop: threading.Event) -> None:
        while not stop.wait(LEASE_SECONDS / 3):
            with contextlib.suppress(Exception):  # a failed renewal shows in check_lock before the commit
                if self._holder(key).get("token") == token:
                    self._upload(key, [memoryview(self._lease_bytes(token))])

    def check_lock(self, lease: Lease) -> str | None:
        holder = self._holder(lease.key)
        if not holder:
            return f"{self.display(lease.key)} was removed (the root deleted?)"
        if holder.get("token") != lease.token:
            return f"{self.display(lease.key)} was taken over by another writer (host {holder.get('host')})"
        return None


def _parse_lease(raw: bytes) -> dict[str, Any]:
    """A lease object's JSON (empty when absent or unreadable: an unreadable one is stale)."""
    try:
        value = json.loads(raw) if raw else {}
    except ValueError:
        value = {}
    return value if isinstance(value, dict) else {}


def _stale(holder: dict[str, Any]) -> bool:
    """Whether a lease's holder is gone: a dead process of this host, or no renewal for too long."""
    renewed = holder.get("renewed")
    if not isinstance(renewed, (int, float)) or time.time() - renewed > LEASE_SECONDS:
        return True
    pid = holder.get("pid")
    if holder.get("host") == socket.gethostname() and isinstance(pid, int):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
    return False


class _ObjectWriter:
    """A new object: chunks kept (as views, no copy) until :meth:`close` uploads them in order."""

    def __init__(self, store: ObjectStore, key: str) -> None:
        self.store, self.key = store, key
        self.views: list[memoryview] = []

    def __enter__(self) -> _ObjectWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.views = []

    def write(self, chunk: Any) -> None:
        self.views.append(memoryview(chunk).cast("B"))

    def patch_head(self, data: bytes) -> None:
        if not self.views or len(self.views[0]) < len(data):
            msg = f"{self.store.display(self.key)}: the head to patch spans several writes"
            raise CheckpointError(msg)
        first = self.views[0]
        self.views[0] = memoryview(bytes(data) + bytes(first[len(data) :]))

    def close(self) -> int:
        self.store._upload(self.key, self.views)
        size = sum(len(view) for view in self.views)
        self.views = []
        return size


class _ObjectReader:
    """An object read by ranged GETs, each bounded by the size the store reported."""

    def __init__(self, store: ObjectStore, key: str, size: int, where: str) -> None:
        self.store, self.key, self.size, self.where = store, key, size, where

    def read_into(self, target: Any, offset: int) -> None:
        view = memoryview(target).cast("B")
        end = offset + len(view)
        if end > self.size:
            msg = f"{self.where}: a read up to byte {end} of an object of {self.size} bytes (truncated?)"
            raise CheckpointError(msg)
        if not len(view):
            return

        def get() -> bytes:
            return bytes(self.store.fs.cat_file(self.key, start=offset, end=end))

        try:
            data = self.store._call("reading", self.key, get)
        except FileNotFoundError:
            msg = f"{self.where}: the file is missing"
            raise CheckpointError(msg) from None
        if len(data) != len(view):
            msg = f"{self.where}: the object shrank while it was read ({len(data)} of {len(view)} bytes)"
            raise CheckpointError(msg)
        view[:] = data

    def direct(self, offset: int, need: int, scratch: dict[str, Any]) -> Any:
        return None  # no page cache to go around: every read is a ranged GET

    def close(self) -> None:
        """Nothing held between reads."""
