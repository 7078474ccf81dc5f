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
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from faccel._checkpoint._background import Meeting
from faccel._checkpoint._background import staged as host_copies
from faccel._checkpoint._background import start as start_in_background
from faccel._checkpoint._background import wait as wait_for_background
from faccel._checkpoint._capture import capture, capture_rng, extras_digests
from faccel._checkpoint._folders import (
    RootLock,
    blocking_file,
    check_lock,
    complete_checkpoints,
    hold_lock,
    latest_checkpoint,
    manifest_step,
    remove_leftovers,
    rotate,
)
from faccel._checkpoint._format import (
    EXTRAS,
    FILE_HASH,
    FORMAT,
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
    named_temporary_name,
    page_name,
    replaced_name,
    rng_name,
    shard_name,
    temporary_name,
    trash_name,
)
from faccel._checkpoint._history import check_checkpoint_name
from faccel._checkpoint._sharded._flow import (
    exchange_records,
    page_content,
    plan_pieces,
    row_split,
)
from faccel._checkpoint._sharded._fsdp_state import full_state, sharded_state
from faccel._checkpoint._sharded._shard_file import write_shard
from faccel._dist._consensus import DEFAULT_ARRIVAL, agree_max, arrive, together
from faccel._dist._process_group import breadcrumb
from faccel._dist._state import DistState
from faccel._loop._deepspeed import is_deepspeed_engine
from faccel._loop._model import is_sharded, unwrap_model
from faccel._loop._zero_state import full_state as deepspeed_full_state
from faccel._storage._durable import (
    FileRecord,
    check_written,
    fsync_dir,
    in_parallel,
    read_verified,
    write_durably,
)
from faccel._storage._safetensors import plan
from faccel._train_state import TrainState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError, CheckpointError

__all__ = ["checkpoint"]

# The hash of each format's file records (docs/checkpoints.md).
_WHOLE_HASH, _SHARDED_HASH = FILE_HASH[VERSION], FILE_HASH[VERSION_SHARDED]


def _json_bytes(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def _write_rank0(
    temporary: Path, content: dict[str, Any], files: Mapping[str, Mapping[str, torch.Tensor]]
) -> dict[str, FileRecord]:
    def write(name: str) -> Callable[[], FileRecord]:
        metadata = MODEL_METADATA if name == MODEL else None
        return lambda: write_durably(
            temporary / name, plan(files[name], metadata=metadata), algorithm=_WHOLE_HASH
        )

    # Side by side: one file's fsync overlaps the next one's writing and hashing.
    names = [MODEL, OPTIMIZER, EXTRAS]
    records = dict(zip(names, in_parallel([write(name) for name in names]), strict=True))
    records[STATE] = write_durably(temporary / STATE, [_json_bytes(content)], algorithm=_WHOLE_HASH)
    return records


def _rng_records(dist: DistState, temporary: Path, records: dict[str, FileRecord]) -> None:
    """Whole tensors: the other ranks' generator files, written on the shared file system, hashed here."""
    for rank in range(dist.world_size):
        name = rng_name(rank)
        if name not in records:
            where = str(temporary / name)
            records[name] = read_verified(temporary / name, None, where=where, algorithm=_WHOLE_HASH)[1]


def _commit(
    dist: DistState,
    root: Path,
    temporary: Path,
    final: Path,
    listed: dict[str, FileRecord],
    content: dict[str, Any],
    keep: int | None,
    lock: RootLock,
    *,
    version: int = VERSION,
    present: Mapping[str, FileRecord] | None = None,
) -> None:
    """Write the manifest of ``listed`` files, check every file (``present`` too), rename: the commit."""
    manifest = manifest_content(content, dist.world_size, listed, version, dist.data_world_size)
    written = {name: listed[name] for name in expected_files(dist.world_size, version)} | dict(present or {})
    written[MANIFEST] = write_durably(temporary / MANIFEST, [_json_bytes(manifest)])
    fsync_dir(temporary)
    what = f"the checkpoint of step {content['step']}"
    check_written(temporary, written, what=what)  # a folder emptied under us is never committed
    lost = check_lock(lock)
    if lost is not None:
        msg = f"{what}: not committed: {lost} while it was written; one writer per checkpoint root"
        raise CheckpointError(msg)
    aside = None
    if final.exists():
        # replace=True: move the old one aside, then the new one in. Between the two renames
        # the folder aside counts as this step (_folders), so a crash leaves one of the two.
        aside = root / replaced_name(final.name)
        os.rename(final, aside)
    os.rename(temporary, final)
    fsync_dir(root)
    try:
        check_written(final, written, what=what)
    except CheckpointError:
        with contextlib.suppress(OSError):  # ours and broken: out of sight (restore would pass it over)
            os.rename(final, root / trash_name(final.name))
        raise
    if aside is not None:
        trash = root / trash_name(final.name)
        os.rename(aside, trash)  # invisible at once; then deleted at leisure
        fsync_dir(root)
        shutil.rmtree(trash, ignore_errors=True)
    if keep is not None:
        rotate(root, keep, content["step"])


def manifest_content(
    content: Mapping[str, Any],
    world: int,
    listed: Mapping[str, FileRecord],
    version: int,
    data_world: int | None = None,
) -> dict[str, Any]:
    """``manifest.json``'s content: ``listed`` holds the records of ``expected_files(world, version)``.

    Version 2 lists one rank page per ``PAGE_RANKS`` ranks: about 100 bytes per 1,024 ranks, at
    most 1,024 pages (``MAX_SHARDED_WORLD`` ranks). Each entry names its hash as the version does.

    Example:
        >>> from faccel._storage._durable import FileRecord
        >>> record = FileRecord(size=1, digest="00", algorithm="sha256")
        >>> listed = {name: record for name in ("state.json", "extras.safetensors", "ranks-00000.json")}
        >>> manifest_content({"step": 3, "epoch": 0, "position": 0}, 2, listed, 2)["files"]["state.json"]
        {'size': 1, 'sha256': '00'}
    """
    algorithm = FILE_HASH[version]
    assert all(listed[name].algorithm == algorithm for name in expected_files(world, version))
    return {
        "format": FORMAT,
        "version": version,
        "step": content["step"],
        "epoch": content["epoch"],
        "position": content["position"],
        "world_size": world,
        # Only when a layout deals the data over fewer ranks (tensor parallelism).
        **({"data_world_size": data_world} if data_world not in (None, world) else {}),
        "torch_version": torch.__version__,
        "files": {
            name: {"size": listed[name].size, algorithm: listed[name].digest}
            for name in expected_files(world, version)
        },
    }


def write_pages(temporary: Path, ranks: list[tuple[FileRecord, FileRecord]]) -> dict[str, FileRecord]:
    """Version 2: the rank pages, each listing the shard and generator records of ``PAGE_RANKS`` ranks."""
    pages = {}
    for page in range(-(-len(ranks) // PAGE_RANKS)):
        first = page * PAGE_RANKS
        content = page_content(first, ranks[first : first + PAGE_RANKS])
        pages[page_name(page)] = write_durably(
            temporary / page_name(page), [_json_bytes(content)], algorithm=_SHARDED_HASH
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
) -> Path:
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
        path: The root folder of the run's checkpoints (created if missing).
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
    root = Path(path)
    step = train_state.step
    final = root / (checkpoint_name(step) if name is None else name)
    temporary = root / (temporary_name(step) if name is None else named_temporary_name(name))
    # A value one rank cannot store fails every rank alike, before they agree (issue 26, item 7).
    rng = together(
        dist,
        lambda: capture_rng(dist, train_state.rank_extras),
        what="capturing the generators and rank_extras",
        raises=CheckpointError,
    )
    _agree(dist, root, train_state, replace=replace, final=final)
    if name is None:  # a named checkpoint meets no numbered one: the next numbered one still checks
        dist.runtime.roots.add(os.fspath(root.absolute()))

    model = unwrap_model(train_state.model)
    fsdp = is_sharded(model)
    if sharded and is_deepspeed_engine(train_state.model):
        msg = (
            "checkpoint(..., sharded=True) of a DeepSpeed run: faccel writes ZeRO's partitions as whole "
            "tensors (gathered one at a time), which restore at any world size and ZeRO stage; pass "
            "sharded=False or leave it out"
        )
        raise ArgumentValueError(msg)
    shards = _use_shards(model, dist, fsdp=fsdp, sharded=sharded)
    # The writing rank holds the root's lock from before its leftovers are removed until the commit
    # (or failure) is over; the OS releases it if the process dies.
    held = contextlib.ExitStack()
    try:
        plan_job = _sharded_job if shards else _whole_job
        job = plan_job(
            dist, train_state, final, temporary, rng, held, replace=replace, keep=keep, copy=not blocking
        )
    except BaseException:
        held.close()
        raise
    if blocking:
        with held:
            _run(dist, job)
    else:
        start_in_background(dist.runtime, step, functools.partial(_run_in_background, dist, job), dist)
    return final


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
    train_state: TrainState,
    final: Path,
    temporary: Path,
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
    model = unwrap_model(train_state.model)
    # FSDP2 in the whole-tensor format: every rank takes part in gathering whole tensors onto
    # rank 0, which then writes them exactly as an unsharded model's (any world size restores them).
    whole = full_state(model, train_state.optimizer) if is_sharded(model) else None
    if is_deepspeed_engine(train_state.model):  # ZeRO's partitions gathered whole, one tensor at a time
        whole = deepspeed_full_state(dist, train_state.model, train_state.optimizer)

    def prepare() -> tuple[dict[str, Any], dict[str, dict[str, torch.Tensor]], RootLock] | None:
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
        records = {rng_name(dist.rank): write_durably(rng_file, [_json_bytes(rng)], algorithm=_WHOLE_HASH)}
        if prepared is not None:
            records |= _write_rank0(temporary, prepared[0], prepared[1])
        return records

    def commit(records: dict[str, FileRecord], ranks: list[tuple[FileRecord, FileRecord]]) -> None:
        assert prepared is not None  # rank 0
        _rng_records(dist, temporary, records)
        _commit(dist, root, temporary, final, records, prepared[0], keep, prepared[2])

    return _Job(step=step, sharded=False, write=write, commit=commit, held=held)


def _use_shards(model: nn.Module, dist: DistState, *, fsdp: bool, sharded: bool | None) -> bool:
    """Whether to write the sharded format: asked for, or by default for an FSDP2 model split by rows."""
    split = all(row_split(p, dist.world_size) for p in model.parameters()) if fsdp else True
    if sharded and not split:
        msg = (
            "checkpoint(..., sharded=True): the model's parameters are not all split by rows over "
            f"all {dist.world_size} ranks (HSDP or tensor parallelism?); the sharded format needs "
            "that layout. Pass sharded=False (whole tensors, gathered on rank 0)"
        )
        raise ArgumentValueError(msg)
    shards = split and fsdp if sharded is None else sharded
    if shards and dist.world_size > MAX_SHARDED_WORLD:
        msg = (
            f"the sharded format holds up to {MAX_SHARDED_WORLD:,} ranks (1,024 rank pages of 1,024, so "
            f"that what a rank reads at start stays bounded); this run has {dist.world_size:,}. Pass "
            "sharded=False (whole tensors, gathered on rank 0)"
        )
        raise ArgumentValueError(msg)
    return shards


def _open_temporary(
    held: contextlib.ExitStack, root: Path, final: Path, temporary: Path, step: int, *, replace: bool
) -> RootLock:
    """On the writing rank: the root's lock taken, leftovers removed, the temporary folder made."""
    root.mkdir(parents=True, exist_ok=True)
    lock = held.enter_context(hold_lock(root))
    remove_leftovers(root)  # under the lock: every temporary folder is a dead writer's
    if not replace and manifest_step(final) is not None:  # written since _agree, by another run
        raise CheckpointError(_exists_message(final, step))
    temporary.mkdir()
    return lock


def _sharded_job(
    dist: DistState,
    train_state: TrainState,
    final: Path,
    temporary: Path,
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
    model = unwrap_model(train_state.model)
    own = sharded_state(model, train_state.optimizer) if is_sharded(model) else None

    def planned() -> tuple[
        dict[str, Any], dict[str, dict[str, torch.Tensor]], dict[str, Any], dict[str, Any]
    ]:
        content, files = capture(dist, train_state, own, shards=True)  # refuses unstorable values first
        index, pieces, placed = plan_pieces(files, dist.rank, dist.world_size)
        content["tensors"] = {
            group: {k: p.to_json() for k, p in entries.items()} for group, entries in index.items()
        }
        if copy:
            pieces = host_copies(dist.runtime, "shards", pieces)
            files = {EXTRAS: host_copies(dist.runtime, EXTRAS, files[EXTRAS])}
        return content, files, pieces, placed

    content, files, pieces, placed = together(
        dist, planned, what=f"planning the checkpoint of step {step}", raises=CheckpointError
    )

    def prepare() -> RootLock | None:
        if not dist.is_main_process:
            return None
        return _open_temporary(held, root, final, temporary, step, replace=replace)

    lock = together(dist, prepare, what=f"preparing the checkpoint of step {step}", raises=CheckpointError)

    def write() -> dict[str, FileRecord]:
        rng_file, shard_file = temporary / rng_name(dist.rank), temporary / shard_name(dist.rank)
        tasks: list[Callable[[], FileRecord]] = [
            lambda: write_durably(rng_file, [_json_bytes(rng)], algorithm=_SHARDED_HASH),
            lambda: write_shard(shard_file, pieces, placed, rank=dist.rank, world=dist.world_size, step=step),
        ]
        if lock is not None:
            tasks.append(
                lambda: write_durably(temporary / STATE, [_json_bytes(content)], algorithm=_SHARDED_HASH)
            )
            tasks.append(
                lambda: write_durably(temporary / EXTRAS, plan(files[EXTRAS]), algorithm=_SHARDED_HASH)
            )
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


def _agree(dist: DistState, root: Path, state: TrainState, *, replace: bool, final: Path) -> None:
    """Every rank learns, in one collective, whether any rank objects to writing this checkpoint."""
    step = state.step
    blocked = blocking_file(root)
    exists = not replace and (
        os.path.exists(final) or manifest_step(root / replaced_name(final.name)) is not None
    )
    # The first checkpoint of this process into a root that already holds later steps: the run
    # would meet them at its first colliding step, hours in (issue 25), so it stops here.
    first = os.fspath(root.absolute()) not in dist.runtime.roots and final.name == checkpoint_name(step)
    ahead = _later_checkpoints(root, step) if first and not replace else []
    digests = extras_digests(state.extras)
    values = [step, _digest(sorted(digests)), _digest(digests)]
    flags = [int(exists), int(blocked is not None), int(bool(ahead))]
    low = agree_max(
        dist,
        [*(-v for v in values), *values, *flags],
        what="the checkpoint's agreement",
        raises=CheckpointError,
    )
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


def _later_checkpoints(root: Path, step: int) -> list[str]:
    try:
        return [folder.name for s, folder in complete_checkpoints(root) if s > step]
    except OSError:  # an unreadable root: the write that follows names what is wrong with it
        return []


def _ahead_message(root: Path, step: int, ahead: list[str]) -> str:
    shown = ", ".join(sorted(ahead)[:5]) + (" ..." if len(ahead) > 5 else "")
    return (
        f"{root}: this run's first checkpoint is step {step}, but the root already holds later "
        f"checkpoints ({shown or 'on another rank'}), from another run or an abandoned future. "
        "This run would stop at the first of them (a checkpoint never overwrites another unasked), "
        "so it stops now instead. Resume from the root (faccel.restore(dist, state, root) takes its "
        "latest), write to a new root, or pass checkpoint(..., replace=True) to overwrite each "
        "later step as this run reaches it"
    )


def _exists_message(final: Path, step: int) -> str:
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


def _resolve(path: Path) -> Path:
    directory = latest_checkpoint(path)
    if directory is None:
        msg = (
            f"{path}: no checkpoint there: neither a checkpoint folder (it has no valid {MANIFEST}) "
            f"nor a folder of complete checkpoints (step-NNNNNNNNNNNN/{MANIFEST})"
        )
        raise CheckpointError(msg)
    return directory
