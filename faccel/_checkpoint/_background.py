"""Non-blocking checkpoints: the write and the commit on a background thread, one at a time.

``checkpoint(..., blocking=False)`` copies the state to host memory (buffers
owned by ``dist.runtime``, reused by the next one, released by
:func:`faccel.free_memory` or ``shutdown``), then hands the writing and the
commit to :func:`start`, which runs them on a thread and returns; the thread
is ``dist.runtime.pending``. At most one runs per runtime handle: the next ``checkpoint``,
``restore`` and ``faccel.shutdown`` first :func:`wait` for it, and a failure
on the thread is raised there, by the next call, as a :class:`CheckpointError`
naming the step (nothing of a failed checkpoint is committed: the commit is
the same rename, after the same checks).

The thread never touches the process group's backend, which the training
thread keeps using (two threads issuing collectives on one group could pair
them differently on different ranks). The ranks meet through the group's
store instead (:class:`Meeting`): every rank publishes its files' records or
its error under a key of this checkpoint, rank 0 commits once all are in,
and publishes the outcome that the other ranks wait for.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from collections.abc import Callable, Mapping

import torch
import torch.distributed as tdist

from faccel._dist._consensus import store_lost_message
from faccel._dist._runtime import Runtime
from faccel._dist._state import DistState
from faccel._torch_compat import default_store
from faccel._typecheck import setup_checked
from faccel.errors import CheckpointError

__all__ = ["COMMITTED_ANYWAY", "Meeting", "free_memory", "release", "staged", "start", "wait"]

# What the error of a check failing after the manifest's write says (an object store's commit):
# the checkpoint is committed, so a background failure must not be reported as "nothing committed".
COMMITTED_ANYWAY = "its manifest was written, so it is committed"


def _outcome(error: BaseException) -> str:
    """How a background checkpoint's failure ends its message: nothing committed, or committed."""
    return "after its commit" if COMMITTED_ANYWAY in str(error) else "and nothing of it was committed"


def staged(runtime: Runtime, group: str, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors`` (contiguous), in ``runtime``'s buffers of the previous call where they fit.

    Buffers are reused because a copy into memory already mapped runs at
    memory speed (5x faster here than into fresh pages). Only called once the
    previous background checkpoint is done (``checkpoint`` waits first), so no
    thread still reads the buffers it overwrites.

    Example:
        >>> import torch
        >>> from faccel._dist._runtime import Runtime
        >>> staged(Runtime(), "doc", {"w": torch.ones(2)})["w"].tolist()
        [1.0, 1.0]
    """
    old = runtime.staging.get(group, {})
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        buffer = old.get(key)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tuple(tensor.shape), dtype=tensor.dtype)
        with torch.no_grad():
            buffer.copy_(tensor.detach())
        out[key] = buffer
    runtime.staging[group] = out
    return out


def release(runtime: Runtime, dist: DistState | None = None) -> None:
    """Wait for ``runtime``'s background checkpoint (raising its failure) and free the staging buffers.

    Example:
        >>> from faccel._dist._runtime import Runtime
        >>> release(Runtime())
    """
    try:
        wait(runtime, dist)
    finally:
        runtime.release_staging()


@setup_checked
def free_memory(dist: DistState) -> None:
    """Release the host staging buffers that non-blocking checkpoints keep for reuse.

    ``checkpoint(..., blocking=False)`` copies the state into host buffers
    owned by ``dist.runtime`` (a full copy of the model and optimizer state)
    and keeps them, so that the next one copies at memory speed. Call this
    when no more non-blocking checkpoints come (before evaluation, or to make
    room); it first waits for the one still being written. The next
    non-blocking checkpoint allocates them again. :func:`faccel.shutdown`
    releases them too. (Accelerate's ``Accelerator.free_memory`` frees
    references it holds; this frees what faccel holds.)

    Args:
        dist: The run's :class:`~faccel.DistState` (its runtime handle holds the buffers).

    Raises:
        CheckpointError: The background checkpoint this waited for failed
            (the buffers are released all the same).
        ArgumentError: ``dist`` is not a :class:`~faccel.DistState`.

    Example:
        >>> import faccel
        >>> faccel.free_memory(faccel.detect({}))
    """
    release(dist.runtime, dist)


class Meeting:
    """The ranks of one background checkpoint, meeting through the process group's store."""

    def __init__(self, dist: DistState, timeout: datetime.timedelta) -> None:
        self.dist = dist
        self.timeout = timeout
        self.store = default_store()
        # This rank's n-th background checkpoint: the same n on every rank (a collective call).
        number = self.store.add(f"faccel/background/calls/rank{dist.rank}", 1)
        self.key = f"faccel/background/{number}"

    def _wait(self, keys: list[str], what: str) -> None:
        try:
            self.store.wait(keys, self.timeout)
        except RuntimeError:  # the store's timeout: a rank died or hangs
            msg = (
                f"{what}: the other ranks did not report within the process group's timeout "
                f"({self.timeout}); a rank died or hangs, and nothing was committed"
            )
            raise CheckpointError(msg) from None

    def gather(self, payload: bytes | None, error: str | None, *, what: str) -> list[bytes]:
        """Publish this rank's payload (or its error); every rank's payloads, or raise if any failed."""
        mine = "-" + error if error is not None else "+" + (payload or b"").hex()
        self.store.set(f"{self.key}/rank{self.dist.rank}", mine)
        keys = [f"{self.key}/rank{rank}" for rank in range(self.dist.world_size)]
        self._wait(keys, what)
        values = [self.store.get(key).decode(errors="replace") for key in keys]
        failed = [rank for rank, value in enumerate(values) if value[:1] != "+"]
        if error is not None:
            raise CheckpointError(error)
        if failed:
            msg = f"{what} failed on rank(s) {failed}: {values[failed[0]][1:]}"
            raise CheckpointError(msg)
        return [bytes.fromhex(value[1:]) for value in values]

    def decide(self, error: str | None, *, what: str) -> None:
        """Rank 0 publishes the commit's outcome; the other ranks wait for it (and raise its error)."""
        result = f"{self.key}/result"
        if self.dist.rank == 0:
            self.store.set(result, "-" + error if error is not None else "+")
            if error is not None:
                raise CheckpointError(error)
            return
        self._wait([result], what)
        value = self.store.get(result)
        if value[:1] != b"+":
            msg = f"{what} failed on rank 0: {value[1:].decode(errors='replace')}"
            raise CheckpointError(msg)


def _failed_key(dist: DistState) -> str:
    return f"faccel/background/failed/rank{dist.rank}"


def _group_store(dist: DistState | None) -> tdist.Store | None:
    if dist is None or not dist.distributed or not tdist.is_initialized():
        return None
    return default_store()


def _unreported(store: tdist.Store | None, key: str) -> str | None:
    """The failure a background checkpoint left in the group's store, taken out (reported once)."""
    if store is None or not store.check([key]):
        return None
    text = store.get(key).decode(errors="replace")
    store.delete_key(key)
    return text


def wait(runtime: Runtime, dist: DistState | None = None, *, call: str = "checkpoint") -> None:
    """Wait for the background checkpoints of this process; raise a failure as a CheckpointError.

    ``runtime``'s own first, then any other still being written (a state from
    another ``detect`` in this process: found among the live threads). With a
    process group (``dist``), a failure is also left in the group's store,
    under this rank's key, until one call reports it: the next ``checkpoint``
    or ``restore`` raises it whichever ``detect`` made its state.

    Example:
        >>> from faccel._dist._runtime import Runtime
        >>> wait(Runtime())  # none running: returns at once
    """
    pending = runtime.pending
    if pending is not None:
        runtime.pending = None
        pending.thread.join()
    for thread in runtime.others_writing():
        thread.join()  # another handle's checkpoint: the ranks' files must be whole first
    store = _group_store(dist)
    try:
        left = _unreported(store, _failed_key(dist)) if dist is not None else None
    except RuntimeError as error:  # torch's DistNetworkError: the store's host (rank 0) is gone
        assert dist is not None
        raise CheckpointError(store_lost_message(dist, call, error)) from error
    if pending is not None and pending.error is not None:
        if store is None or left is not None:  # not reported yet by a call of another handle
            msg = (
                f"the background checkpoint of step {pending.step} (checkpoint(..., blocking=False)) "
                f"failed, {_outcome(pending.error)}: {pending.error}"
            )
            raise CheckpointError(msg) from pending.error
    elif left is not None:
        raise CheckpointError(left)


def start(runtime: Runtime, step: int, task: Callable[[], None], dist: DistState | None = None) -> None:
    """Run ``task`` (a checkpoint's write and commit) on a background thread; see :func:`wait`."""
    wait(runtime, dist)
    runtime.at_close("background checkpoint", functools.partial(release, runtime, dist))
    store = _group_store(dist)

    def run() -> None:
        try:
            task()
        except BaseException as error:  # kept for the next call to raise
            pending.error = error
            if store is not None and dist is not None:
                msg = (
                    f"the background checkpoint of step {step} (checkpoint(..., blocking=False)) "
                    f"failed, {_outcome(error)}: {error}"
                )
                with contextlib.suppress(RuntimeError):  # the store is gone: the owner still raises it
                    store.set(_failed_key(dist), msg)

    pending = runtime.background(step, run)
    pending.thread.start()
