"""A checkpoint's jobs: what each rank writes, and the commit, in either format.

``_save`` runs the flow across ranks (check in, agree, then a job to its end, here or on a
thread); a job is planned here from one record of its arguments (:class:`JobArgs`), by
:func:`whole_job` (version 3: rank 0 writes the tensors, every rank its generators) or
:func:`sharded_job` (version 2: every rank its own chunks). Both end in :func:`commit_folder`:
every file checked, then the manifest written last (``Store.commit``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from faccel._checkpoint._background import COMMITTED_ANYWAY
from faccel._checkpoint._background import staged as host_copies
from faccel._checkpoint._capture import capture
from faccel._checkpoint._folders import check_lock, hold_lock, manifest_step, remove_leftovers, rotate
from faccel._checkpoint._format import (
    EXTRAS,
    FILE_HASH,
    MANIFEST,
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
    rng_name,
    shard_name,
)
from faccel._checkpoint._manifest import Manifest, RankPage
from faccel._checkpoint._sharded._flow import plan_pieces
from faccel._checkpoint._sharded._shard_file import write_shard
from faccel._checkpoint._state_file import StateFile
from faccel._checkpoint._strategies import StrategyState
from faccel._dist._consensus import together
from faccel._dist._state import DistState
from faccel._storage._durable import FileRecord, in_parallel
from faccel._storage._roots import spot_of
from faccel._storage._safetensors import plan
from faccel._storage._store import Lease, Spot
from faccel._train_state import TrainState
from faccel.errors import CheckpointError

__all__ = [
    "Job",
    "JobArgs",
    "check_written",
    "exists_message",
    "json_bytes",
    "manifest_content",
    "sharded_job",
    "whole_job",
    "write_pages",
]

# The hash of each format's file records (docs/checkpoints.md).
_WHOLE_HASH, _SHARDED_HASH = FILE_HASH[VERSION], FILE_HASH[VERSION_SHARDED]


@attrs.frozen(kw_only=True)
class JobArgs:
    """What a checkpoint's job is planned from: the same on every rank, but ``rng`` (this rank's)."""

    dist: DistState
    strategy: StrategyState
    train_state: TrainState
    final: Spot  # the committed folder's place
    temporary: Spot  # where its files are written before the commit (Store.staging)
    rng: dict[str, Any]  # this rank's generators, captured before the ranks agreed
    held: contextlib.ExitStack = attrs.field(eq=False)  # the root's lock, held to the job's end
    replace: bool
    keep: int | None
    copy: bool  # a background job: tensors copied to host memory before the call returns


def json_bytes(value: Any) -> bytes:
    """``value`` as compact JSON (no NaN), one line."""
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
    records[STATE] = (temporary / STATE).write([json_bytes(content.encode())], algorithm=_WHOLE_HASH)
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


def commit_folder(
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
            f"{COMMITTED_ANYWAY}: restore checks every file of it before use and passes a damaged one over"
            if committed
            else "nothing was committed as complete"
        )
        check_written(Spot(root.store, folder), written, what=what, outcome=outcome)
        lost = check_lock(root, lock)
        if lost is not None:
            msg = f"{what}: {lost} while it was written (one writer per checkpoint root); {outcome}"
            raise CheckpointError(msg)

    root.store.commit(temporary.key, final.key, MANIFEST, [json_bytes(manifest)], check=check)
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
            [json_bytes(content)], algorithm=_SHARDED_HASH
        )
    return pages


@attrs.frozen(kw_only=True)
class Job:
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


def whole_job(args: JobArgs) -> Job:
    """The whole-tensor format (version 3): rank 0 writes the tensors; every rank its generators."""
    dist, strategy, train_state, final = args.dist, args.strategy, args.train_state, args.final
    temporary, rng, held = args.temporary, args.rng, args.held
    step, root = train_state.step, final.parent
    # A strategy that holds the state in pieces (FSDP2, ZeRO) gathers whole tensors onto rank 0,
    # which writes them exactly as an unsharded model's (any world size restores them). Every rank
    # takes part, inside the ranks' agreement: a peer lost in the gather is this step's named
    # error on the survivors, not the backend's.
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
        if args.copy:
            files = {name: host_copies(dist.runtime, name, tensors) for name, tensors in files.items()}
        return content, files, _open_temporary(held, root, final, temporary, step, replace=args.replace)

    prepared = together(
        dist, prepare, what=f"preparing the checkpoint of step {step}", raises=CheckpointError
    )

    def write() -> dict[str, FileRecord]:
        rng_file = temporary / rng_name(dist.rank)
        records = {rng_name(dist.rank): rng_file.write([json_bytes(rng)], algorithm=_WHOLE_HASH)}
        if prepared is not None:
            records |= _write_rank0(temporary, prepared[0], prepared[1])
        return records

    def commit(records: dict[str, FileRecord], ranks: list[tuple[FileRecord, FileRecord]]) -> None:
        assert prepared is not None  # rank 0
        _rng_records(dist, temporary, records)
        commit_folder(dist, root, temporary, final, records, prepared[0], args.keep, prepared[2])

    return Job(step=step, sharded=False, write=write, commit=commit, held=held)


def _open_temporary(
    held: contextlib.ExitStack, root: Spot, final: Spot, temporary: Spot, step: int, *, replace: bool
) -> Lease:
    """On the writing rank: the root's lock taken, leftovers removed, the temporary folder made."""
    root.store.make_folder(root.key)
    lock = held.enter_context(hold_lock(root))
    remove_leftovers(root)  # under the lock: every uncommitted folder is a dead writer's
    if manifest_step(final) is not None:  # written since _agree, by another run
        if not replace:
            raise CheckpointError(exists_message(final, step))
        if not root.store.renames:
            msg = (
                f"{final}: checkpoint(..., replace=True) of a committed step on object storage: the "
                "store has no rename, so the old checkpoint would be gone before the new one is "
                "whole. Delete the old one first, or checkpoint the next step"
            )
            raise CheckpointError(msg)
    root.store.make_folder(temporary.key)
    return lock


def sharded_job(args: JobArgs) -> Job:
    """The sharded format (version 2): every rank writes its own chunks; rank 0 the rest and the commit."""
    dist, strategy, train_state, final = args.dist, args.strategy, args.train_state, args.final
    temporary, rng, held = args.temporary, args.rng, args.held
    step, root = train_state.step, final.parent

    def planned() -> tuple[StateFile, dict[str, dict[str, torch.Tensor]], dict[str, Any], dict[str, Any]]:
        own = strategy.shard_state(train_state.model, train_state.optimizer)
        content, files = capture(dist, train_state, own, shards=True)  # refuses unstorable values first
        index, pieces, placed = plan_pieces(files, dist.rank, dist.world_size, strategy.held)
        content = attrs.evolve(
            content,
            tensors={group: {k: p.to_json() for k, p in entries.items()} for group, entries in index.items()},
        )
        if args.copy:
            pieces = host_copies(dist.runtime, "shards", pieces)
            files = {EXTRAS: host_copies(dist.runtime, EXTRAS, files[EXTRAS])}
        return content, files, pieces, placed

    content, files, pieces, placed = together(
        dist, planned, what=f"planning the checkpoint of step {step}", raises=CheckpointError
    )

    def prepare() -> Lease | None:
        if not dist.is_main_process:
            return None
        return _open_temporary(held, root, final, temporary, step, replace=args.replace)

    lock = together(dist, prepare, what=f"preparing the checkpoint of step {step}", raises=CheckpointError)

    def write() -> dict[str, FileRecord]:
        rng_file, shard_file = temporary / rng_name(dist.rank), temporary / shard_name(dist.rank)
        tasks: list[Callable[[], FileRecord]] = [
            lambda: rng_file.write([json_bytes(rng)], algorithm=_SHARDED_HASH),
            lambda: write_shard(shard_file, pieces, placed, rank=dist.rank, world=dist.world_size, step=step),
        ]
        if lock is not None:
            encoded = json_bytes(content.encode())
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
        commit_folder(
            dist,
            root,
            temporary,
            final,
            listed,
            content,
            args.keep,
            lock,
            version=VERSION_SHARDED,
            present=present,
        )

    return Job(step=step, sharded=True, write=write, commit=commit, held=held)


def exists_message(final: Spot, step: int) -> str:
    """Why a checkpoint at ``final`` is not written again unasked (``replace=True`` is the way)."""
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
