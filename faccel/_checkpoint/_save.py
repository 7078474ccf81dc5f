"""``checkpoint``: a TrainState to a folder of safetensors and JSON, atomically, across ranks.

The layout is in ``_format`` (and docs/checkpoints.md). The commit is one
``rename`` of a fully written and fsynced temporary folder, so a crash at any
moment leaves the earlier checkpoints whole and the partial one invisible
(restore only reads ``step-*`` folders). Under DDP every rank calls
``checkpoint``; the ranks first check in (``arrive``: a call made on some ranks
only fails within ``arrival_timeout``) and agree on the step, that it is new
(or ``replace=True``) and that their extras are equal; rank 0 writes everything
but the other ranks' RNG files, and the ranks meet three times (prepare, write,
commit). In the sharded format (version 2, the default for FSDP2) every rank
writes its own chunks (``_sharded._flow``), and rank 0 commits once every
rank's records have reached it. ``blocking=False`` runs the write and the
commit on a thread (``_background``). All ranks must see one shared file
system. The reverse flow is ``_restore``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from faccel._checkpoint._background import Meeting
from faccel._checkpoint._background import staged as host_copies
from faccel._checkpoint._background import start as start_in_background
from faccel._checkpoint._background import wait as wait_for_background
from faccel._checkpoint._capture import capture, capture_rng, extras_digests
from faccel._checkpoint._folders import (
    blocking_file,
    check_lock,
    complete_checkpoints,
    hold_lock,
    manifest_step,
    remove_leftovers,
    rotate,
    writable_root,
)
from faccel._checkpoint._format import (
    EXTRAS,
    FILE_HASH,
    MANIFEST,
    MAX_SHARDED_WORLD,
    MODEL,
    MODEL_METADATA,
    OPTIMIZER,
    PAGE_RANKS,
    STATE,
    VERSION,
    VERSION_SHARDED,
    checkpoint_name,
    expected_files,
    page_name,
    replaced_name,
    rng_name,
    shard_name,
)
from faccel._checkpoint._history import check_checkpoint_name
from faccel._checkpoint._manifest import Manifest, RankPage
from faccel._checkpoint._sharded._flow import exchange_records, plan_pieces
from faccel._checkpoint._sharded._shard_file import write_shard
from faccel._checkpoint._state_file import StateFile
from faccel._checkpoint._strategies import StrategyState, strategy_of
from faccel._dist._consensus import DEFAULT_ARRIVAL, agree_max, arrive, together
from faccel._dist._process_group import breadcrumb
from faccel._dist._state import DistState
from faccel._storage._durable import FileRecord, in_parallel
from faccel._storage._roots import shown, spot_of
from faccel._storage._safetensors import plan
from faccel._storage._store import Lease, Spot
from faccel._train_state import TrainState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError, CheckpointError

__all__ = ["checkpoint"]

# The hash of each format's file records (docs/checkpoints.md).
_WHOLE_HASH, _SHARDED_HASH = FILE_HASH[VERSION], FILE_HASH[VERSION_SHARDED]


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _write_rank0(
    temporary: Spot, content: StateFile, files: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, FileRecord]:
    def write(name: str) -> Callable[[], FileRecord]:
        metadata = MODEL_METADATA if name == MODEL else None
        return lambda: (temporary / name).write(plan(files[name], metadata=metadata), algorithm=_WHOLE_HASH)

    # Side by side: one file's fsync overlaps the next one's writing and hashing.
    names = [MODEL, OPTIMIZER, EXTRAS]
    records = dict(zip(names, in_parallel([write(name) for name in names]), strict=True))
    records[STATE] = (temporary / STATE).write([_json_bytes(content.encode())], algorithm=_WHOLE_HASH)
    return records


def _rng_records(dist: DistState, temporary: Spot, records: dict[str, FileRecord]) -> None:
    """Whole tensors: the other ranks' generator files, written on the shared storage, hashed here."""
    for rank in range(dist.world_size):
        name = rng_name(rank)
        if name not in records:
            where = str(temporary / name)
            records[name] = (temporary / name).read(None, where=where, algorithm=_WHOLE_HASH)[1]


def check_written(
    folder: Spot,
    records: Mapping[str, FileRecord],
    *,
    what: str,
    outcome: str = "nothing was committed as complete",
) -> None:
    """Check that every file of ``records`` is still in ``folder``, of its size (one listing).

    Called on a written folder just before and just after its commit, so a
    folder emptied or changed under the writer (the root deleted, another
    process in the root) is reported, not committed. Sizes only: the hashes
    were computed from the bytes as they were written, and re-reading every
    file would double a checkpoint's I/O.

    Raises:
        CheckpointError: naming ``what``, the file and what differs, and ``outcome`` (what became
            of the checkpoint).
    """
    sizes = folder.sizes()
    for name, record in records.items():
        size = sizes.get(name)
        if size is None:
            msg = (
                f"{what}: {folder / name} is gone after it was written: something else "
                f"deletes or writes in this folder (the root removed during the write?); {outcome}"
            )
            raise CheckpointError(msg)
        if size != record.size:
            msg = (
                f"{what}: {folder / name} changed after it was written ({size} bytes, not "
                f"{record.size}): something else writes in this folder; {outcome}"
            )
            raise CheckpointError(msg)


def _commit(
    dist: DistState,
    root: Spot,
    temporary: Spot,
    final: Spot,
    listed: dict[str, FileRecord],
    content: StateFile,
    keep: int | None,
    lock: Lease,
    *,
    version: int = VERSION,
    present: Mapping[str, FileRecord] | None = None,
) -> None:
    """Check every file (``present`` too), then write the manifest of ``listed`` files last: the commit
    (``Store.commit``: on a disk, then one rename; on an object store, the manifest's write itself)."""
    counters = {"step": content.step, "epoch": content.epoch, "position": content.position}
    manifest = manifest_content(counters, dist.world_size, listed, version, dist.data_world_size)
    written = {name: listed[name] for name in expected_files(dist.world_size, version)} | dict(present or {})
    what = f"the checkpoint of step {content.step}"

    def check(folder: str, committed: bool) -> None:
        # ``committed``: the store wrote the manifest already (an object store's commit), so the
        # error must not say the checkpoint is lost: it is there, and restore checks it before use.
        outcome = (
            "its manifest was written, so it is committed: restore checks every file of it before use "
            "and passes a damaged one over"
            if committed
            else "nothing was committed as complete"
        )
        check_written(Spot(root.store, folder), written, what=what, outcome=outcome)
        lost = check_lock(root, lock)
        if lost is not None:
            msg = f"{what}: {lost} while it was written (one writer per checkpoint root); {outcome}"
            raise CheckpointError(msg)

    root.store.commit(temporary.key, final.key, MANIFEST, [_json_bytes(manifest)], check=check)
    if keep is not None:
        rotate(root, keep, content.step)


def manifest_content(
    content: Mapping[str, Any],
    world: int,
    listed: Mapping[str, FileRecord],
    version: int,
    data_world: int | None = None,
) -> dict[str, Any]:
    """``manifest.json``'s content (:class:`Manifest`'s encoding): ``listed`` holds the records of
    ``expected_files(world, version)``.

    Example:
        >>> from faccel._storage._durable import FileRecord
        >>> record = FileRecord(size=1, digest="00", algorithm="sha256")
        >>> listed = {name: record for name in ("state.json", "extras.safetensors", "ranks-00000.json")}
        >>> manifest_content({"step": 3, "epoch": 0, "position": 0}, 2, listed, 2)["files"]["state.json"]
        {'size': 1, 'sha256': '00'}
    """
    return Manifest(
        version=version,
        step=content["step"],
        epoch=content["epoch"],
        position=content["position"],
        world_size=world,
        data_world_size=data_world,
        files={name: listed[name] for name in expected_files(world, version)},
    ).encode()


def write_pages(temporary: Spot | Path, ranks: list[tuple[FileRecord, FileRecord]]) -> dict[str, FileRecord]:
    """Version 2: the rank pages, each listing the shard and generator records of ``PAGE_RANKS`` ranks."""
    folder = spot_of(temporary)
    pages = {}
    for page in range(-(-len(ranks) // PAGE_RANKS)):
        first = page * PAGE_RANKS
        content = RankPage(first=first, ranks=ranks[first : first + PAGE_RANKS]).encode()
        pages[page_name(page)] = (folder / page_name(page)).write(
            [_json_bytes(content)], algorithm=_SHARDED_HASH
        )
    return pages


@setup_checked
def checkpoint(
    dist: DistState,
    train_state: TrainState,
    path: str | os.PathLike[str],
    *,
    keep: int | None = None,
    replace: bool = False,
    arrival_timeout: datetime.timedelta = DEFAULT_ARRIVAL,
    sharded: bool | None = None,
    blocking: bool = True,
    name: str | None = None,
) -> Path | str:
    """Save ``train_state`` as ``path/step-NNNNNNNNNNNN``, atomically and durably, without pickle.

    Tensors go to safetensors, everything else (optimizer param groups,
    scheduler and scaler state, step, epoch, position (and, given
    ``TrainState.loader``, the position in the epoch's global order, which
    any world size resumes from), each rank's random
    generators, extras) to JSON, and a manifest lists every file with its
    size and SHA-256. The checkpoint is written into a temporary sibling
    folder, every file and the folder are fsynced, and one rename makes it
    visible: a crash at any moment leaves the earlier checkpoints whole, and
    the partial one invisible to :func:`restore`.

    The step names the checkpoint, and you advance it
    (``state = attrs.evolve(state, step=state.step + 1)`` after each optimizer
    step): writing a step that already exists is refused, unless ``replace``.

    Under DDP call it on every rank, not under ``if dist.is_main_process:``:
    rank 0 writes the model, optimizer, state and extras (which must be equal
    on every rank; per-rank values go to ``rank_extras``), every rank writes
    its own random generators and rank extras, and every rank returns once the
    checkpoint is committed. The folder must be on a file system that all
    ranks share. Training must not change the tensors while this call runs
    (it reads them in place, without copies).

    Args:
        dist: The run's :class:`DistState`.
        train_state: What to save.
        path: The root folder of the run's checkpoints (created if missing), or a URL of object
            storage (``s3://bucket/run``, ``gs://...``: the manifest's conditional write commits,
            a lease object is the lock; docs/object-storage.md). The result is then a URL.
        keep: Keep only this many checkpoints, the new one included, deleting
            the oldest (folders with a higher step than this one are never
            deleted). None keeps all.
        replace: Replace an existing checkpoint of the same step (a crash
            while replacing leaves the old one or the new one, whole).
        arrival_timeout: How long the ranks that called ``checkpoint`` wait
            for the others to call it too, before raising.
        sharded: Write the sharded format (version 2): every rank writes the
            tensors it owns (an FSDP2 model's own shards; replicated tensors
            split between the ranks, balanced by bytes) to its own file, so no
            rank gathers the whole state, and ``restore`` at any world size
            reads only the rows each rank needs. None (the default): sharded
            for an FSDP2 model split by rows over all ranks, whole tensors
            (version 3, a Hugging Face ``model.safetensors`` inside) otherwise.
        blocking: False: copy the state to host memory, return, and write and
            commit on a background thread (the same files, checks and atomic
            commit; the ranks meet through the process group's store, never
            its backend, which training keeps using). The returned folder
            exists once that is done: the next ``checkpoint``, ``restore`` or
            :func:`faccel.shutdown` waits for it, and raises its failure as a
            ``CheckpointError`` (nothing of a failed one is committed). Costs
            a host copy of the state (this rank's shards, when sharded).
        name: Write ``path/NAME`` (``"best"``, ``"epoch_0"``) instead of the
            step's folder: a named checkpoint beside the numbered ones, with
            the same files, checks and atomic commit. ``restore(dist, state,
            path / NAME)`` reads it; ``restore(dist, state, path)`` never takes
            it as the latest and ``keep`` never rotates it. An existing name is
            refused unless ``replace`` (``replace=True`` for a ``best`` you
            overwrite). Letters, digits, ``_``, ``.`` and ``-``, starting with
            a letter or digit, not of a step folder's form.

    Returns:
        The new checkpoint's folder.

    Raises:
        ArgumentValueError: ``keep`` < 1, ``keep`` with ``name``, a ``name``
            that is not one plain folder name, a simulated DistState of several
            ranks, or ``sharded=True`` for a model sharded otherwise than by
            rows over all ranks (HSDP, tensor parallelism).
        CheckpointError: A checkpoint of this step exists (and not
            ``replace``); this process's first checkpoint into ``path`` finds
            later steps there (another run's, or an abandoned future: the run
            would stop at the first of them, so it stops now; restore from the
            root, use a new one, or ``replace``); ``path`` or a parent is a file; the ranks pass
            different steps or different extras; a rank did not call
            ``checkpoint`` within ``arrival_timeout``; the ranks' meeting
            outlived the process group's timeout (the message names the step
            and ``faccel.detect(timeout=...)``); a value with no pickle-free
            form in the state (the message names it), or a failed write on
            any rank; another process is writing into ``path`` (one writer
            per root: the writing rank holds an OS lock, ``fcntl.flock`` on
            ``path/.lock``, and a second writer is refused at once, the message
            naming the holder's host and pid); the folder being written
            changed under the writer (``path`` deleted during the write: the
            files are checked against the manifest before and after the commit
            rename); a background checkpoint (``blocking=False``) before this
            one failed. Earlier checkpoints are untouched.

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
    if name is not None:
        check_checkpoint_name(name, keep=keep)
    if dist.world_size > 1 and not dist.distributed:
        msg = (
            f"a simulated DistState of {dist.world_size} ranks has no peers to write their "
            "generator files; checkpoint from a real run (faccel.detect under a launcher), "
            "or with a one-process DistState"
        )
        raise ArgumentValueError(msg)
    breadcrumb(dist, "checkpoint", step=train_state.step)
    wait_for_background(dist.runtime, dist)  # the previous non-blocking checkpoint is committed first
    arrive(dist, "checkpoint", timeout=arrival_timeout, raises=CheckpointError)
    root = together(
        dist, lambda: writable_root(path), what="opening the checkpoint root", raises=CheckpointError
    )
    step = train_state.step
    final = root / (checkpoint_name(step) if name is None else name)
    temporary = Spot(root.store, root.store.staging(final.key))
    # A value one rank cannot store fails every rank alike, before they agree (issue 26, item 7).
    rng = together(
        dist,
        lambda: capture_rng(dist, train_state.rank_extras),
        what="capturing the generators and rank_extras",
        raises=CheckpointError,
    )
    _agree(dist, root, train_state, replace=replace, final=final)
    if name is None:  # a named checkpoint meets no numbered one: the next numbered one still checks
        dist.runtime.roots.add(_root_name(root))

    strategy = strategy_of(train_state.model)
    shards = _use_shards(strategy, train_state.model, dist, sharded=sharded)
    # The writing rank holds the root's lock from before its leftovers are removed until the commit
    # (or failure) is over; the OS releases it if the process dies.
    held = contextlib.ExitStack()
    try:
        plan_job = _sharded_job if shards else _whole_job
        job = plan_job(
            dist,
            strategy,
            train_state,
            final,
            temporary,
            rng,
            held,
            replace=replace,
            keep=keep,
            copy=not blocking,
        )
    except BaseException:
        held.close()
        raise
    if blocking:
        with held:
            _run(dist, job)
    else:
        start_in_background(dist.runtime, step, functools.partial(_run_in_background, dist, job), dist)
    return shown(final)


def _root_name(root: Spot) -> str:
    """The root as one string per place: a local one made absolute (the roots this process wrote)."""
    return root.store.canonical(root.key)


@attrs.frozen(kw_only=True)
class _Job:
    """A checkpoint planned (state captured, folder made): its writing and its commit are left.

    ``write`` writes this rank's files and returns their records; ``commit``
    (rank 0, which holds ``held``'s lock) takes those and, in the sharded
    format, every rank's ``(shard, rng)`` records.
    """

    step: int
    sharded: bool
    write: Callable[[], dict[str, FileRecord]]
    commit: Callable[[dict[str, FileRecord], list[tuple[FileRecord, FileRecord]]], None]
    held: contextlib.ExitStack


def _run(dist: DistState, job: _Job) -> None:
    """A job to the end in this thread: the ranks meet through the process group (``together``)."""
    step = job.step
    records = together(dist, job.write, what=f"writing the checkpoint of step {step}", raises=CheckpointError)
    ranks = []
    if job.sharded:
        ranks = exchange_records(dist, records[shard_name(dist.rank)], records[rng_name(dist.rank)])

    def commit() -> None:
        if dist.is_main_process:
            job.commit(records, ranks)

    together(dist, commit, what=f"committing the checkpoint of step {step}", raises=CheckpointError)


def _run_in_background(dist: DistState, job: _Job) -> None:
    """A job to the end on the background thread: the ranks meet through the store, not the backend."""
    with job.held:
        if not dist.distributed:
            own = job.write()
            job.commit(own, [(own[shard_name(0)], own[rng_name(0)])] if job.sharded else [])
            return
        meeting = Meeting(dist, dist.timeout)
        what = f"writing the checkpoint of step {job.step}"
        records: dict[str, FileRecord] = {}
        try:
            records = job.write()
            payload = b"".join(
                bytes(_record_bytes(records[name]))
                for name in (shard_name(dist.rank), rng_name(dist.rank))
                if job.sharded
            )
            error = None
        except Exception as failure:  # published, so that every rank raises
            payload, error = None, f"{what} failed on rank {dist.rank}: {failure}"
        gathered = meeting.gather(payload, error, what=what)
        ranks = (
            [(_record_of(raw[:40], _SHARDED_HASH), _record_of(raw[40:80], _SHARDED_HASH)) for raw in gathered]
            if job.sharded
            else []
        )
        failure_text = None
        if dist.is_main_process:
            try:
                job.commit(records, ranks)
            except Exception as failure:  # published to the other ranks, then raised here
                failure_text = f"committing the checkpoint of step {job.step}: {failure}"
        meeting.decide(failure_text, what=f"committing the checkpoint of step {job.step}")


def _record_bytes(record: FileRecord) -> bytes:
    return record.size.to_bytes(8, "little") + bytes.fromhex(record.digest)


def _record_of(raw: bytes, algorithm: str) -> FileRecord:
    return FileRecord(size=int.from_bytes(raw[:8], "little"), digest=raw[8:40].hex(), algorithm=algorithm)


def _whole_job(
    dist: DistState,
    strategy: StrategyState,
    train_state: TrainState,
    final: Spot,
    temporary: Spot,
    rng: dict[str, Any],
    held: contextlib.ExitStack,
    *,
    replace: bool,
    keep: int | None,
    copy: bool,
) -> _Job:
    """The whole-tensor format (version 3): rank 0 writes the tensors; every rank its generators."""
    step = train_state.step
    root = final.parent
    # A strategy that holds the state in pieces (FSDP2, ZeRO) gathers whole tensors onto rank 0,
    # which writes them exactly as an unsharded model's (any world size restores them). Every rank
    # takes part, inside the ranks' agreement: a peer lost in the gather is this step's named
    # error on the survivors (issue 35, item 1), not the backend's.
    whole = together(
        dist,
        lambda: strategy.whole_state(dist, train_state.model, train_state.optimizer),
        what=f"gathering the state of the checkpoint of step {step}",
        raises=CheckpointError,
    )

    def prepare() -> tuple[StateFile, dict[str, dict[str, torch.Tensor]], Lease] | None:
        if not dist.is_main_process:
            return None
        content, files = capture(dist, train_state, whole)  # refuses unstorable values before any file
        if copy:
            files = {name: host_copies(dist.runtime, name, tensors) for name, tensors in files.items()}
        return content, files, _open_temporary(held, root, final, temporary, step, replace=replace)

    prepared = together(
        dist, prepare, what=f"preparing the checkpoint of step {step}", raises=CheckpointError
    )

    def write() -> dict[str, FileRecord]:
        rng_file = temporary / rng_name(dist.rank)
        records = {rng_name(dist.rank): rng_file.write([_json_bytes(rng)], algorithm=_WHOLE_HASH)}
        if prepared is not None:
            records |= _write_rank0(temporary, prepared[0], prepared[1])
        return records

    def commit(records: dict[str, FileRecord], ranks: list[tuple[FileRecord, FileRecord]]) -> None:
        assert prepared is not None  # rank 0
        _rng_records(dist, temporary, records)
        _commit(dist, root, temporary, final, records, prepared[0], keep, prepared[2])

    return _Job(step=step, sharded=False, write=write, commit=commit, held=held)


def _use_shards(strategy: StrategyState, model: Any, dist: DistState, *, sharded: bool | None) -> bool:
    """Whether to write the sharded format: asked for, or by the strategy's default (FSDP2 split by rows)."""
    problem = strategy.sharded_problem(dist, model) if sharded else None
    if problem is not None:
        raise ArgumentValueError(problem)
    shards = strategy.shards_by_default(dist, model) if sharded is None else sharded
    if shards and dist.world_size > MAX_SHARDED_WORLD:
        msg = (
            f"the sharded format holds up to {MAX_SHARDED_WORLD:,} ranks (1,024 rank pages of 1,024, so "
            f"that what a rank reads at start stays bounded); this run has {dist.world_size:,}. Pass "
            "sharded=False (whole tensors, gathered on rank 0)"
        )
        raise ArgumentValueError(msg)
    return shards


def _open_temporary(
    held: contextlib.ExitStack, root: Spot, final: Spot, temporary: Spot, step: int, *, replace: bool
) -> Lease:
    """On the writing rank: the root's lock taken, leftovers removed, the temporary folder made."""
    root.store.make_folder(root.key)
    lock = held.enter_context(hold_lock(root))
    remove_leftovers(root)  # under the lock: every uncommitted folder is a dead writer's
    if manifest_step(final) is not None:  # written since _agree, by another run
        if not replace:
            raise CheckpointError(_exists_message(final, step))
        if not root.store.renames:
            msg = (
                f"{final}: checkpoint(..., replace=True) of a committed step on object storage: the "
                "store has no rename, so the old checkpoint would be gone before the new one is "
                "whole. Delete the old one first, or checkpoint the next step"
            )
            raise CheckpointError(msg)
    root.store.make_folder(temporary.key)
    return lock


def _sharded_job(
    dist: DistState,
    strategy: StrategyState,
    train_state: TrainState,
    final: Spot,
    temporary: Spot,
    rng: dict[str, Any],
    held: contextlib.ExitStack,
    *,
    replace: bool,
    keep: int | None,
    copy: bool,
) -> _Job:
    """The sharded format (version 2): every rank writes its own chunks; rank 0 the rest and the commit."""
    step = train_state.step
    root = final.parent

    def planned() -> tuple[StateFile, dict[str, dict[str, torch.Tensor]], dict[str, Any], dict[str, Any]]:
        own = strategy.shard_state(train_state.model, train_state.optimizer)
        content, files = capture(dist, train_state, own, shards=True)  # refuses unstorable values first
        index, pieces, placed = plan_pieces(files, dist.rank, dist.world_size)
        content = attrs.evolve(
            content,
            tensors={group: {k: p.to_json() for k, p in entries.items()} for group, entries in index.items()},
        )
        if copy:
            pieces = host_copies(dist.runtime, "shards", pieces)
            files = {EXTRAS: host_copies(dist.runtime, EXTRAS, files[EXTRAS])}
        return content, files, pieces, placed

    content, files, pieces, placed = together(
        dist, planned, what=f"planning the checkpoint of step {step}", raises=CheckpointError
    )

    def prepare() -> Lease | None:
        if not dist.is_main_process:
            return None
        return _open_temporary(held, root, final, temporary, step, replace=replace)

    lock = together(dist, prepare, what=f"preparing the checkpoint of step {step}", raises=CheckpointError)

    def write() -> dict[str, FileRecord]:
        rng_file, shard_file = temporary / rng_name(dist.rank), temporary / shard_name(dist.rank)
        tasks: list[Callable[[], FileRecord]] = [
            lambda: rng_file.write([_json_bytes(rng)], algorithm=_SHARDED_HASH),
            lambda: write_shard(shard_file, pieces, placed, rank=dist.rank, world=dist.world_size, step=step),
        ]
        if lock is not None:
            encoded = _json_bytes(content.encode())
            tasks.append(lambda: (temporary / STATE).write([encoded], algorithm=_SHARDED_HASH))
            tasks.append(lambda: (temporary / EXTRAS).write(plan(files[EXTRAS]), algorithm=_SHARDED_HASH))
        done = in_parallel(tasks)
        names = [rng_name(dist.rank), shard_name(dist.rank), STATE, EXTRAS][: len(done)]
        return dict(zip(names, done, strict=True))

    def commit(records: dict[str, FileRecord], ranks: list[tuple[FileRecord, FileRecord]]) -> None:
        assert lock is not None  # rank 0
        present = {shard_name(r): s for r, (s, _) in enumerate(ranks)}
        present |= {rng_name(r): g for r, (_, g) in enumerate(ranks)}
        listed = {STATE: records[STATE], EXTRAS: records[EXTRAS]} | write_pages(temporary, ranks)
        _commit(
            dist,
            root,
            temporary,
            final,
            listed,
            content,
            keep,
            lock,
            version=VERSION_SHARDED,
            present=present,
        )

    return _Job(step=step, sharded=True, write=write, commit=commit, held=held)


def _digest(value: Any) -> int:
    """62 bits of the SHA-256 of ``value``'s JSON: room to negate it in an int64 ``all_reduce``."""
    return int.from_bytes(hashlib.sha256(json.dumps(value).encode()).digest()[:8], "little") >> 2


def _agree(dist: DistState, root: Spot, state: TrainState, *, replace: bool, final: Spot) -> None:
    """Every rank learns, in one collective, whether any rank objects to writing this checkpoint."""
    step = state.step
    # The first checkpoint of this process into a root that already holds later steps: the run
    # would meet them at its first colliding step, hours in (issue 25), so it stops here. A named
    # checkpoint meets no numbered one.
    first = _root_name(root) not in dist.runtime.roots and final.name == checkpoint_name(step)
    # Reading the root can fail on one rank alone (an object store unreachable from it): the
    # failure is one more flag of the agreement, so that every rank raises at once instead of
    # waiting in the next collective for a rank that left (issue 33, item 2).
    failed: CheckpointError | None = None
    blocked, exists, ahead = None, False, list[str]()
    try:
        blocked = blocking_file(root)
        exists, ahead = _taken(root, step, final, first=first, replace=replace)
    except CheckpointError as error:
        failed = error
    digests = extras_digests(state.extras)
    values = [step, _digest(sorted(digests)), _digest(digests)]
    flags = [int(exists), int(blocked is not None), int(bool(ahead)), int(failed is not None)]
    low = agree_max(
        dist,
        [*(-v for v in values), *values, *flags],
        what="the checkpoint's agreement",
        raises=CheckpointError,
    )
    if failed is not None:
        raise failed
    if low[9]:
        msg = (
            f"checkpoint of step {step} into {root}: another rank could not read the root (its own "
            "error says why: the store unavailable or refusing it); nothing was written"
        )
        raise CheckpointError(msg)
    if -low[0] != low[3]:
        msg = (
            f"the ranks are checkpointing different steps ({-low[0]} to {low[3]}); "
            "pass the same TrainState.step"
        )
        raise CheckpointError(msg)
    if blocked is not None or low[7]:
        where = blocked if blocked is not None else root
        msg = (
            f"{where} is a file, not a folder: checkpoint(..., path) writes a folder of "
            f"step-NNNNNNNNNNNN checkpoints at {root}; pass the path of a folder (new or existing), "
            "for example a 'checkpoints' folder beside that file"
        )
        raise CheckpointError(msg)
    if low[8]:  # before "this step exists": the later ones are what the user must choose about
        raise CheckpointError(_ahead_message(root, step, ahead))
    if low[6]:
        raise CheckpointError(_exists_message(final, step))
    if -low[1] != low[4] or -low[2] != low[5]:
        differ = sorted(digests)
        if -low[1] == low[4]:  # the same names: find which of them differ
            each = agree_max(
                dist,
                [*(-d for d in digests.values()), *digests.values()],
                what="the checkpoint's agreement on extras",
                raises=CheckpointError,
            )
            differ = [name for i, name in enumerate(digests) if -each[i] != each[len(digests) + i]]
        msg = (
            f"extras {differ} differ between ranks: checkpoint saves rank 0's extras and restore "
            "gives them to every rank, so the other ranks would get rank 0's values back. Keep extras "
            "equal on every rank (reduce a per-rank value first, e.g. with faccel.reduce), or put "
            "per-rank values in TrainState.rank_extras, which saves and restores each rank's own"
        )
        raise CheckpointError(msg)


def _taken(root: Spot, step: int, final: Spot, *, first: bool, replace: bool) -> tuple[bool, list[str]]:
    """Whether ``step`` is taken (a folder of its name: on a disk any, on an object store a committed
    one), and the later complete checkpoints when they matter: one listing of the root."""
    if replace:
        return False, []
    try:
        listing = complete_checkpoints(root) if first else []
    except OSError:  # an unreadable root: the write that follows names what is wrong with it
        listing = []
    if root.store.renames:
        exists = (
            root.store.is_folder(final.key) or manifest_step(root / replaced_name(final.name)) is not None
        )
    else:
        exists = manifest_step(final) is not None
    return exists, [folder.name for s, folder in listing if s > step]


def _ahead_message(root: Spot, step: int, ahead: list[str]) -> str:
    shown = ", ".join(sorted(ahead)[:5]) + (" ..." if len(ahead) > 5 else "")
    return (
        f"{root}: this run's first checkpoint is step {step}, but the root already holds later "
        f"checkpoints ({shown or 'on another rank'}), from another run or an abandoned future. "
        "This run would stop at the first of them (a checkpoint never overwrites another unasked), "
        "so it stops now instead. Resume from the root (faccel.restore(dist, state, root) takes its "
        "latest), write to a new root, or pass checkpoint(..., replace=True) to overwrite each "
        "later step as this run reaches it"
    )


def _exists_message(final: Spot, step: int) -> str:
    if final.name != checkpoint_name(step):
        return (
            f"{final}: a checkpoint named {final.name!r} already exists, and a checkpoint never "
            "overwrites another unasked; pass checkpoint(..., name=..., replace=True) to write it "
            "again (a crash while replacing leaves the old one or the new one, whole), or another name"
        )
    return (
        f"{final}: a checkpoint of step {step} already exists, and a checkpoint never "
        "overwrites another unasked. The step names the checkpoint, and faccel does not count "
        "it for you: advance the step after each optimizer step, with state = attrs.evolve("
        "state, step=state.step + 1, position=state.position + 1). To write this step again on "
        "purpose, pass "
        "checkpoint(..., replace=True)"
    )
