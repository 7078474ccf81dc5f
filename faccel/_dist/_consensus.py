"""A barrier that carries news: every rank learns whether any rank failed.

A plain barrier after file work hangs the healthy ranks when one rank raised
before reaching it (a full disk on rank 0, a corrupt file seen by rank 1).
Here each rank runs its part, catches its own error, and all ranks meet in
one ``all_reduce`` of a small integer tensor; then every rank raises if any
failed. The same collective is the barrier. Tensors, not
``broadcast_object_list``, because that one pickles. A collective that
outlives the process group's timeout (a rank still writing) becomes the
caller's named error, which says what to raise.

:func:`arrive` comes first, before any collective of a call that every rank
must make: a check-in through the process group's store with its own short
deadline, so that a call made on some ranks only (``if main process:
checkpoint(...)``) fails within that deadline, naming the missing ranks,
instead of waiting out the backend's timeout inside a collective.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as tdist

from faccel._dist._process_group import comm_device, last_calls, require_group
from faccel._dist._state import DistState
from faccel._torch_compat import default_store
from faccel.errors import DistributedError, FaccelError

__all__ = ["DEFAULT_ARRIVAL", "agree_max", "arrive", "store_lost_message", "together"]

T = TypeVar("T")
# How long the ranks that called a collective wait for the others to call it too.
DEFAULT_ARRIVAL = datetime.timedelta(seconds=60)
# A check-in's count: arrivals, plus this much for each rank that gave up waiting.
_GAVE_UP = 1 << 32


def _all_reduce(
    dist: DistState, values: Sequence[int], op: tdist.ReduceOp.RedOpType, *, name: str
) -> list[int]:
    if not dist.distributed:
        return list(values)
    require_group(dist, name)
    tensor = torch.tensor(list(values), dtype=torch.int64, device=comm_device(dist))
    tdist.all_reduce(tensor, op=op)
    return [int(v) for v in tensor.tolist()]


def agree_max(
    dist: DistState,
    values: Sequence[int],
    *,
    what: str = "the ranks' agreement",
    raises: type[Exception] = DistributedError,
) -> list[int]:
    """Element-wise maximum of ``values`` over all ranks (the values themselves in one process).

    A peer lost, or a wait past the process group's timeout, is ``raises``
    naming ``what`` (the caller's step: a checkpoint's is a ``CheckpointError``),
    as in :func:`together`, not the backend's bare error.
    """
    try:
        return _all_reduce(dist, values, tdist.ReduceOp.MAX, name="agree_max")
    except FaccelError:
        raise
    except RuntimeError as error:
        raise raises(_lost_message(dist, what, error)) from error


def _waited(store: tdist.Store, keys: list[str], timeout: datetime.timedelta) -> bool:
    try:
        store.wait(keys, timeout)
    except RuntimeError:  # torch's DistStoreError: the deadline passed
        return False
    return True


def arrive(dist: DistState, name: str, *, timeout: datetime.timedelta, raises: type[Exception]) -> None:
    """Wait until every rank has called ``name()``, at most ``timeout``; else raise ``raises``.

    Every rank counts itself in under a key of this call (the ``n``-th call of
    ``name`` in the process); the rank that completes the count says whether
    all came in time. A rank that waited ``timeout`` in vain marks the key as
    given up and raises, naming the ranks that did not come; a rank arriving
    after that raises at once instead of entering a collective alone. Nothing
    goes through the backend, so the process group stays usable.
    """
    if not dist.distributed:
        return
    require_group(dist, name)
    # Never longer than the job's own timeout (FACCEL_TIMEOUT): a peer that is gone must not
    # keep the survivors waiting a fixed minute the user did not ask for.
    timeout = min(timeout, dist.timeout)
    try:
        _check_in(dist, name, timeout=timeout, raises=raises)
    except FaccelError:
        raise
    except RuntimeError as error:  # torch's DistNetworkError: the store's host is gone
        raise raises(store_lost_message(dist, name, error)) from error


def store_lost_message(dist: DistState, name: str, error: RuntimeError) -> str:
    """What a rank says when the process group's store stopped answering during ``name()``."""
    first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
    return (
        f"{name}() on rank {dist.rank}: the rendezvous store at {dist.master_addr}:"
        f"{dist.master_port} cannot be reached ({first}); the process that hosts it (rank 0, or "
        "torchrun's agent) has probably died: its log says why. Restart the job from the latest "
        "checkpoint"
    )


def _check_in(dist: DistState, name: str, *, timeout: datetime.timedelta, raises: type[Exception]) -> None:
    store = default_store()
    # This rank's n-th call of ``name``, counted in the group's own store: it lives and dies
    # with the process group (a module-level counter would outlive a shutdown and disagree
    # with the peers of the next group).
    number = store.add(f"faccel/arrive/{name}/calls/rank{dist.rank}", 1) - 1
    key = f"faccel/arrive/{name}/{number}"
    decided = f"{key}/decided"
    store.set(f"{key}/rank{dist.rank}", "1")
    count = store.add(key, 1)
    if count % _GAVE_UP == dist.world_size:  # the last to arrive decides for everyone
        store.set(decided, "late" if count > _GAVE_UP else "ok")
    elif count > _GAVE_UP:
        msg = (
            f"{name}() on rank {dist.rank}: the other ranks gave up waiting for this rank "
            f"(it came after their arrival_timeout, or they called {name}() at another point of "
            f"the program); {name}() is a collective: every rank must call it at the same point"
        )
        raise raises(msg)
    if not _waited(store, [decided], timeout):
        count = store.add(key, _GAVE_UP)
        if count % _GAVE_UP != dist.world_size:
            missing = [rank for rank in range(dist.world_size) if not store.check([f"{key}/rank{rank}"])]
            came = [rank for rank in range(dist.world_size) if rank not in missing]
            msg = (
                f"{name}() was called on rank(s) {came} only: rank(s) {missing} did not call it "
                f"within {timeout} (the smaller of arrival_timeout and the job's timeout, "
                f"FACCEL_TIMEOUT){last_calls(dist, missing)}. Either that rank crashed, was killed "
                f"or left the program (its "
                f"log or exit code says which), or it runs another part of the program: {name}() "
                f"is a collective, every rank must call it at the same point, not under `if "
                f"dist.is_main_process:` (faccel writes from the main process by itself). If a "
                f"rank is only slow to arrive (a long evaluation), raise both timeouts"
            )
            raise raises(msg)
        _waited(store, [decided], timeout)  # the last arrival came just now: it is deciding
    if store.get(decided) != b"ok":
        msg = (
            f"{name}() on rank {dist.rank}: another rank gave up waiting before every rank had "
            f"called it (arrival_timeout {timeout}); every rank must call {name}() at the same point"
        )
        raise raises(msg)


def together(dist: DistState, work: Callable[[], T], *, what: str, raises: type[Exception]) -> T:
    """Run ``work`` on this rank, then wait for all ranks; raise if any rank failed.

    The rank that failed re-raises its own error (an ``OSError`` as a
    ``raises`` naming ``what``); the others raise ``raises`` saying how many
    ranks failed at ``what``. ``raises`` is the caller's class (a checkpoint's
    failure is a ``CheckpointError``, ``save_model``'s a ``StorageError``).
    A meeting that outlives the process group's timeout, or loses a rank,
    raises ``raises`` naming ``what`` and the timeout to raise.
    """
    try:
        result = work()
    except Exception as error:
        _meet(dist, 1, what=what, raises=raises)
        if isinstance(error, OSError):  # a full disk, a permission: say what was being done
            msg = f"{what} failed on rank {dist.rank}: {error}"
            raise raises(msg) from error
        raise
    failures = _meet(dist, 0, what=what, raises=raises)
    if failures:
        msg = (
            f"{what} failed on {failures} other rank(s) of {dist.world_size}; that rank's error "
            "says why. Nothing was committed or loaded on this rank"
        )
        raise raises(msg)
    return result


def _meet(dist: DistState, failed: int, *, what: str, raises: type[Exception]) -> int:
    try:
        (failures,) = _all_reduce(dist, [failed], tdist.ReduceOp.SUM, name="together")
    except FaccelError:
        raise
    except RuntimeError as error:  # gloo's and NCCL's timeouts, a peer's closed connection
        raise raises(_lost_message(dist, what, error)) from error
    return failures


def _lost_message(dist: DistState, what: str, error: RuntimeError) -> str:
    first = (
        str(error).strip().splitlines()[0].split(". ")[0][:200]
        if str(error).strip()
        else type(error).__name__
    )
    return (
        f"{what}: rank {dist.rank} waited for the other ranks longer than the process group's "
        f"timeout ({dist.timeout}), or lost one of them ({first}). If {what} takes that long "
        "(a slow or network file system, a large model), start the job with a larger "
        "faccel.detect(timeout=...); if a rank died, its own error says why"
    )
