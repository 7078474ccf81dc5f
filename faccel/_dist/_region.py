"""A step that ranks run together by point-to-point messages: a failure on one rank is named on all.

A pipeline schedule and exact mode's gradient exchange are collective
regions: each rank computes, then waits for its peers' messages. When one
rank raises inside (a refusal, the user's loss function, a kill), the peers
are left inside the backend's wait, and what ends it is the backend's bare
error: gloo's ``Connection closed by peer`` as soon as the failed process
exits, or its timeout (``dist.timeout``) if the process lives on.

:func:`region` makes both ends say who failed. A rank whose own code raises
inside the region writes one key to the process group's store (its rank,
where and what it raised) before the error leaves the region; a rank whose
wait ends with the backend's error reads the peers' keys and raises
:class:`~faccel.errors.RankFailedError` naming the rank and its error, or,
when no peer wrote (a process killed or gone without a word), naming the
peers it was waiting on. The key is written before the failed process can
close its connections or time out, so the peer reads it when it looks. One
store write on the failing path; on the path that succeeds, one attribute
read (a rank that caught its failure and completes a later region deletes
its key, so a later loss is not blamed on it).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch.distributed as tdist

from faccel._dist._state import DistState
from faccel._torch_compat import default_store
from faccel.errors import FaccelError, RankFailedError

__all__ = ["announce", "is_backend_error", "lost_message", "region"]

# What gloo's and NCCL's errors for a lost peer or a timed-out wait say (torch raises them as plain
# RuntimeError; its DistError subclasses cover the store's and newer backends' errors).
_BACKEND_MARKS = (
    "gloo",
    "Connection closed by peer",
    "Connection reset by peer",
    "Timed out waiting",
    "NCCL",
    "ProcessGroup",
)


def is_backend_error(error: BaseException) -> bool:
    """Whether ``error`` is the backend's (a lost peer, a timeout), not a mistake of this rank's code.

    Example:
        >>> is_backend_error(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4"))
        True
        >>> is_backend_error(RuntimeError("grad can be implicitly created only for scalar outputs"))
        False
    """
    if isinstance(error, FaccelError):
        return False
    if isinstance(error, tdist.DistError):
        return True
    return type(error) is RuntimeError and any(mark in str(error) for mark in _BACKEND_MARKS)


def _key(rank: int) -> str:
    return f"faccel/region/failed/rank{rank}"


def _first_line(error: BaseException, limit: int = 300) -> str:
    """``Type: first line`` of ``error`` (to its first sentence), and of its cause (torch wraps a stage's).

    Example:
        >>> _first_line(RuntimeError("[/src/gloo/pair.cc:553] Connection closed by peer. Typically ..."))
        'RuntimeError: Connection closed by peer'
    """
    text = str(error).strip()
    line = text.splitlines()[0].split(". ")[0] if text else ""
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line)[:limit].rstrip(":")  # gloo's source location
    said = f"{type(error).__name__}: {line}" if line else type(error).__name__
    cause = error.__cause__
    if cause is not None and not isinstance(cause, tdist.DistError):
        said += f", from {_first_line(cause, limit)}"
    return said


def announce(dist: DistState, what: str, error: BaseException) -> None:
    """Tell the peers, through the store, that this rank raised ``error`` inside ``what``. Never raises."""
    if not dist.distributed or not tdist.is_initialized():
        return
    try:
        default_store().set(_key(dist.rank), f"{what}: {_first_line(error)}")
    except RuntimeError:  # the store's host is gone: the peers name this rank as lost instead
        return
    dist.runtime.announced = True


def _withdraw(dist: DistState) -> None:
    """This rank completed a region after announcing a failure (the user caught it): take it back."""
    dist.runtime.announced = False
    try:
        default_store().delete_key(_key(dist.rank))
    except RuntimeError:  # the store's host is gone: nothing to take back
        return


def _announced(peers: Sequence[int]) -> dict[int, str]:
    out: dict[int, str] = {}
    try:
        store = default_store()
        for rank in peers:
            if store.check([_key(rank)]):
                out[rank] = store.get(_key(rank)).decode(errors="replace")
    except RuntimeError:  # the store's host is gone with the failed rank
        return out
    return out


def lost_message(dist: DistState, what: str, peers: Sequence[int], error: BaseException) -> str:
    """What a rank whose wait inside ``what`` ended with the backend's ``error`` says."""
    said = _announced(peers)
    if said:
        ranks = sorted(said)
        told = "; ".join(f"rank {rank} raised in {said[rank]}" for rank in ranks)
        return (
            f"{what} on rank {dist.rank}: rank(s) {ranks} failed while this rank waited for them ({told}). "
            "That rank's own error says what to fix; the process group cannot be trusted after a step "
            "left half done, so restart the job (from the latest checkpoint)"
        )
    return (
        f"{what} on rank {dist.rank}: lost rank(s) {list(peers)} (this rank's peers in it) without a "
        f"word from them: killed, crashed or exited, or hung past the timeout ({dist.timeout}); the "
        f"backend said {_first_line(error, 160)}. Their logs or exit codes say why; restart the job "
        "(from the latest checkpoint)"
    )


@contextmanager
def region(dist: DistState, what: str, peers: Sequence[int] | None = None) -> Iterator[None]:
    """Run a collective region: this rank's own error is announced, a lost peer becomes RankFailedError.

    ``peers``: the global ranks this rank waits on inside it; None: every other rank.

    Example:
        >>> import faccel
        >>> with region(faccel.detect({}), "a step", peers=()):
        ...     pass
    """
    try:
        yield
        if dist.runtime.announced:
            _withdraw(dist)
    except RankFailedError:
        raise
    except Exception as error:
        if dist.distributed and is_backend_error(error):
            others = [r for r in range(dist.world_size) if r != dist.rank] if peers is None else peers
            raise RankFailedError(lost_message(dist, what, others, error)) from error
        announce(dist, what, error)
        raise
