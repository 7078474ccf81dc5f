"""``checkpoint``: a TrainState to a folder of safetensors and JSON, atomically, across ranks: the flow.

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
system. What each rank writes, and the commit, are the jobs of ``_jobs``; this
module is the flow around them. The reverse flow is ``_restore``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from faccel._checkpoint._background import Meeting
from faccel._checkpoint._background import start as start_in_background
from faccel._checkpoint._background import wait as wait_for_background
from faccel._checkpoint._capture import capture_rng, extras_digests
from faccel._checkpoint._folders import (
    blocking_file,
    complete_checkpoints,
    manifest_step,
    writable_root,
)
from faccel._checkpoint._format import (
    FILE_HASH,
    MAX_SHARDED_WORLD,
    VERSION_SHARDED,
    checkpoint_name,
    replaced_name,
    rng_name,
    shard_name,
)
from faccel._checkpoint._history import check_checkpoint_name
from faccel._checkpoint._jobs import Job, JobArgs, exists_message, sharded_job, whole_job
from faccel._checkpoint._sharded._flow import exchange_records
from faccel._checkpoint._strategies import StrategyState, strategy_of
from faccel._dist._consensus import DEFAULT_ARRIVAL, agree_max, arrive, together
from faccel._dist._process_group import breadcrumb
from faccel._dist._state import DistState
from faccel._storage._durable import FileRecord
from faccel._storage._roots import shown
from faccel._storage._store import Spot
from faccel._train_state import TrainState
from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError, CheckpointError

__all__ = ["checkpoint"]

# The hash of the sharded format's file records (docs/checkpoints.md).
_SHARDED_HASH = FILE_HASH[VERSION_SHARDED]


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
    # A value one rank cannot store fails every rank alike, before they agree.
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
        args = JobArgs(
            dist=dist,
            strategy=strategy,
            train_state=train_state,
            final=final,
            temporary=temporary,
            rng=rng,
            held=held,
            replace=replace,
            keep=keep,
            copy=not blocking,
        )
        job = sharded_job(args) if shards else whole_job(args)
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


def _run(dist: DistState, job: Job) -> None:
    """A job to the end in this thread: the ranks meet through the process group (``together``)."""
    step = job.step
    records = together(dist, job.write, what=f"writing the checkpoint of step {step}", raises=CheckpointError)
    ranks = []
    if job.sharded:
        ranks = exchange_records(dist, records[shard_name(dist.rank)], records[rng_name(dist.rank)])

    committed = []

    def commit() -> None:
        if dist.is_main_process:
            job.commit(records, ranks)
            committed.append(True)

    try:
        together(dist, commit, what=f"committing the checkpoint of step {step}", raises=CheckpointError)
    except CheckpointError as error:
        if not committed:
            raise
        # The commit is done (rank 0 wrote the manifest) and a peer was lost only at the meeting
        # after it: say so, or a survivor reads that its committed checkpoint was lost.
        msg = (
            f"the checkpoint of step {step} is committed (this rank wrote its manifest), and restore "
            f"takes it; the other ranks were lost at the meeting after the commit: {error}"
        )
        raise CheckpointError(msg) from error


def _run_in_background(dist: DistState, job: Job) -> None:
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


def _digest(value: Any) -> int:
    """62 bits of the SHA-256 of ``value``'s JSON: room to negate it in an int64 ``all_reduce``."""
    return int.from_bytes(hashlib.sha256(json.dumps(value).encode()).digest()[:8], "little") >> 2


def _agree(dist: DistState, root: Spot, state: TrainState, *, replace: bool, final: Spot) -> None:
    """Every rank learns, in one collective, whether any rank objects to writing this checkpoint."""
    step = state.step
    # The first checkpoint of this process into a root that already holds later steps: the run
    # would meet them at its first colliding step, hours in, so it stops here. A named
    # checkpoint meets no numbered one.
    first = _root_name(root) not in dist.runtime.roots and final.name == checkpoint_name(step)
    # Reading the root can fail on one rank alone (an object store unreachable from it): the
    # failure is one more flag of the agreement, so that every rank raises at once instead of
    # waiting in the next collective for a rank that left.
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
        raise CheckpointError(exists_message(final, step))
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
