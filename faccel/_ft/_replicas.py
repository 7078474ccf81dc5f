"""Replica groups that come and go between steps, on torchft's quorum (docs/fault-tolerance.md).

A step begins with a quorum (:func:`replica_quorum`): torchft's lighthouse names the
replicas alive now, the process group is rebuilt when that set changed, and a replica
behind the others (just restarted, or one that discarded a step they committed) receives
the live state from a peer, pickle-free (``_transport.py``), before it computes anything.
The step ends with :func:`replica_commit`: the replicas' gradients gathered and combined in
one fixed order (``_combine.py``), then the commit vote (``_manager.py``); a step in which
the collective failed is discarded (no optimizer step, the data position stays), and the
next step begins with a quorum of whoever is left.

With ``quorum_every=K`` a quorum begins every K-th committed step instead, and at once after
a discarded step (:func:`quorum_due`); between quorums the participants are those of the
last one. Every replica of a quorum counts from the same step, so all of them ask for the
next quorum at the same step: what changes is only how long a restarted replica waits
to be let in (up to K steps).
"""

from __future__ import annotations

import datetime
import logging
import socket
from typing import Any

import attrs
import torch
from torch.distributed.distributed_c10d import AllgatherOptions

from faccel._dist._state import DistState
from faccel._ft._combine import combine, flat_grads, set_flat_grads
from faccel._ft._manager import commit_alone, forget_quorum, quorum_id
from faccel._ft._rows import ReplicaRows, epoch_order, replica_rows, sample_counts
from faccel._train_state import TrainState
from faccel.errors import ArgumentValueError, DistributedError, MissingExtraError, UsageError

__all__ = [
    "FaultTolerance",
    "ReplicaQuorum",
    "fault_tolerant",
    "quorum_due",
    "replica_commit",
    "replica_quorum",
]

_HOOK = "fault_tolerance"


@attrs.frozen(kw_only=True)
class ReplicaQuorum:
    """One step's quorum, as this replica sees it.

    Attributes:
        state: The state to step from: the one given, or the one received from a
            live peer when this replica healed (its model and optimizer are loaded
            in place).
        quorum_id: torchft's number of the quorum; it changes when replicas come or go.
        replica_rank: This replica's rank among the ``participants``.
        participants: Replicas taking part in the step.
        rows: This replica's positions of the epoch's order (``indices`` are the samples there).
        indices: The dataset indices this replica reads in the step (empty only at an
            epoch's end with fewer samples left than replicas).
        counts: Samples each replica rank reads, for the mean over the step's samples.
        healed: Whether this replica received the state from a peer in this quorum.
        failed: Whether the quorum itself failed here (the step will be discarded).
        retries: Quorums this replica asked for again before this one formed (each
            did not form within the ``quorum_timeout`` of :func:`fault_tolerant`).
        fresh: Whether this step asked torchft for a quorum; false between the quorums
            of ``quorum_every`` (the participants are the last quorum's).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=None)
        >>> rows = replica_rows(epoch=0, consumed=0, dataset_size=8, batch_size=2, replica_rank=1,
        ...                     participants=2)
        >>> ReplicaQuorum(state=state, quorum_id=1, replica_rank=1, participants=2, rows=rows,
        ...               indices=(6, 1), counts=(2, 2), healed=False, failed=False).rows.start
        2
    """

    state: TrainState
    quorum_id: int
    replica_rank: int
    participants: int
    rows: ReplicaRows
    indices: tuple[int, ...]
    counts: tuple[int, ...]
    healed: bool
    failed: bool
    retries: int = 0
    fresh: bool = True


def quorum_due(*, step: int, quorum_at: int | None, every: int) -> bool:
    """Whether the step that starts at ``step`` begins with a quorum.

    ``quorum_at`` is the step the last quorum began at, or None when there is none to go
    on from (the first step, or the step after a discarded one). Every replica of a
    quorum is at the same step when it forms and commits the same steps after it, so
    all of them find a quorum due at the same step.

    Example:
        >>> [quorum_due(step=s, quorum_at=4, every=3) for s in (4, 5, 6, 7)]
        [False, False, False, True]
        >>> quorum_due(step=5, quorum_at=None, every=3)
        True
    """
    return quorum_at is None or step - quorum_at >= every


class FaultTolerance:
    """This replica's handle on the fault-tolerant dimension: torchft's manager, its process group.

    Made by :func:`fault_tolerant`, closed by :func:`faccel.shutdown` (or :meth:`close`).
    It holds the state of the step in progress so that torchft can send it to a
    healing peer from its quorum thread.

    Example:
        >>> ft = FaultTolerance(manager=None, pg=None, store=None, dataset_size=96, batch_size=4, seed=0)
        >>> ft.live is None, ft.closed, ft.quorum_retries, ft.quorum_every
        (True, False, 5, 1)
    """

    def __init__(
        self,
        *,
        manager: Any,
        pg: Any,
        store: Any,
        dataset_size: int,
        batch_size: int,
        seed: int,
        replica: int = 0,
        quorum_retries: int = 5,
        quorum_every: int = 1,
    ) -> None:
        self.manager = manager
        self.pg = pg
        self.store = store
        self.dataset_size = dataset_size
        self.batch_size = batch_size
        self.seed = seed
        self.replica = replica
        self.quorum_retries = quorum_retries
        self.quorum_every = quorum_every
        # The step the last quorum began at; None when the next step must ask for one.
        self.quorum_at: int | None = None
        self.live: TrainState | None = None
        self.healed = False
        self.closed = False
        # The current epoch's order, drawn once an epoch: drawing it is a permutation of the
        # whole dataset, far more than a step's work on a large one.
        self._order: tuple[int, torch.Tensor] | None = None

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's order of sample indices (``_rows.epoch_order``), drawn once an epoch."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, epoch_order(self.seed, epoch, self.dataset_size))
        return self._order[1]

    def capture(self) -> dict[str, Any]:
        """What a healing peer receives: the checkpoint's content, from the live objects."""
        state = self.live
        if state is None:  # pragma: no cover - torchft asks only once a quorum began
            msg = "no step has begun on this replica: nothing to send"
            raise DistributedError(msg)
        return {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict() if state.optimizer is not None else None,
            "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
            "step": state.step,
            "epoch": state.epoch,
            "consumed": state.consumed,
            "extras": dict(state.extras),
        }

    def load(self, received: dict[str, Any]) -> None:
        """The received content loaded into the live objects, in place; the record follows."""
        state = self.live
        if state is None:  # pragma: no cover - torchft heals only inside a quorum
            msg = "no step has begun on this replica: nowhere to load the state"
            raise DistributedError(msg)
        state.model.load_state_dict(received["model"])
        if state.optimizer is not None:
            state.optimizer.load_state_dict(received["optimizer"])
        if state.scheduler is not None:
            state.scheduler.load_state_dict(received["scheduler"])
        epoch = received["epoch"]
        self.live = attrs.evolve(
            state,
            step=received["step"],
            epoch=epoch,
            position=0,
            resumed_at=(epoch, received["consumed"]),
            extras=received["extras"],
        )
        self.healed = True

    def close(self) -> None:
        """Leave the quorum: stop torchft's manager (its server, its threads) and the process group."""
        if not self.closed:
            self.closed = True
            self.manager.shutdown(wait=False)


def _torchft() -> Any:
    try:
        import torchft
    except ImportError:
        msg = (
            "fault-tolerant replicas run on torchft, which is not installed; install the extra: "
            "pip install 'faccel[ft]' (docs/fault-tolerance.md)"
        )
        raise MissingExtraError(msg) from None
    return torchft


def fault_tolerant(
    dist: DistState,
    state: TrainState,
    *,
    replica: int,
    lighthouse: str,
    dataset_size: int,
    batch_size: int,
    min_replicas: int = 1,
    host: str | None = None,
    timeout: datetime.timedelta = datetime.timedelta(seconds=30),
    quorum_timeout: datetime.timedelta | None = None,
    quorum_retries: int = 5,
    quorum_every: int = 1,
) -> FaultTolerance:
    """Join the fault-tolerant data-parallel dimension as replica ``replica``.

    Every replica runs the same loop; each may die and be restarted at any step. The
    first quorum after a start makes a replica that is behind (a restarted one, or every
    replica but one at the very start) receive the live state from a peer: no
    checkpoint is read. Restore a checkpoint before this call only when no replica is
    alive (the whole job starts again).

    Args:
        dist: This process's state (:func:`faccel.detect`). A replica is one process here.
        state: The state to start from (its model and optimizer are stepped in place).
        replica: This replica's number, stable across its restarts (``0 <= replica``).
        lighthouse: The address of torchft's lighthouse (``http://host:port``).
        dataset_size: Samples in an epoch (the data rule: docs/fault-tolerance.md).
        batch_size: Samples each replica reads in a step.
        min_replicas: Fewest replicas that may commit a step.
        host: The name peers reach this replica by (default: this machine's host name).
        timeout: How long a quorum, a collective, a rebuild of the process group or a
            transfer may take before the step is given up.
        quorum_timeout: How long one request for a quorum waits before it is asked
            for again (default: ``timeout``).
        quorum_retries: How many times a quorum that did not form within ``quorum_timeout``
            is asked for again before :func:`replica_quorum` raises. When a replica dies, the
            others can each be held for a timeout in the step it died in (the collective,
            the rebuild of the process group, a transfer to it), and the lighthouse waits
            for them: the default rides out several such timeouts in a row.
        quorum_every: Begin a quorum every this many committed steps (and at once after
            a discarded one). 1, the default, asks at every step; more saves torchft's
            round trip to the lighthouse on the steps between (a few milliseconds each,
            docs/fault-tolerance.md) at the price of a restarted replica waiting up to
            this many steps to join. A death is noticed at the step it happens either
            way. Give every replica the same value, and the lighthouse a join timeout
            longer than this many steps (docs/fault-tolerance.md).

    Returns:
        The handle the loop passes to :func:`replica_quorum` and :func:`replica_commit`.

    Raises:
        ArgumentValueError: ``dist`` has more than one process, or a size is not positive.
        MissingExtraError: torchft is not installed.

    Example:
        >>> import faccel, torch
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> state = faccel.TrainState.create(model=model, optimizer=optimizer)
        >>> fault_tolerant(faccel.detect(), state, replica=0, lighthouse="http://127.0.0.1:1",
        ...                dataset_size=0, batch_size=4)
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: fault_tolerant needs dataset_size >= 1, got 0: ...
    """
    for name, value, unit in (
        ("dataset_size", dataset_size, "samples"),
        ("batch_size", batch_size, "samples"),
        ("min_replicas", min_replicas, "replicas"),
        ("quorum_every", quorum_every, "steps"),
    ):
        if value < 1:
            msg = f"fault_tolerant needs {name} >= 1, got {value}: pass a count of {unit}"
            raise ArgumentValueError(msg)
    if replica < 0:
        msg = f"fault_tolerant needs replica >= 0, got {replica}: number the replicas 0, 1, ..."
        raise ArgumentValueError(msg)
    if quorum_retries < 0:
        msg = f"fault_tolerant needs quorum_retries >= 0, got {quorum_retries}: pass a count of retries"
        raise ArgumentValueError(msg)
    if dist.world_size != 1:
        msg = (
            f"fault_tolerant runs one process per replica; this process is one of {dist.world_size} "
            "(a replica group of several ranks is not supported yet): start each replica as its own job"
        )
        raise ArgumentValueError(msg)
    torchft = _torchft()
    from torch.distributed import TCPStore

    from faccel._ft._transport import PeerTransport

    # The replica's own store: torchft's manager server registers in it, and the quorum's
    # process group meets in the store of the quorum's first replica.
    store = TCPStore("0.0.0.0", 0, 1, True, wait_for_workers=False)
    pg = torchft.ProcessGroupGloo(timeout=timeout)
    manager = torchft.Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_replicas,
        use_async_quorum=False,
        timeout=timeout,
        quorum_timeout=quorum_timeout or timeout,
        connect_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr=host or socket.gethostname(),
        store_port=store.port,
        lighthouse_addr=lighthouse,
        replica_id=f"faccel_replica_{replica}",
        hostname=host or socket.gethostname(),
        checkpoint_transport=PeerTransport(pg),
    )
    ft = FaultTolerance(
        manager=manager,
        pg=pg,
        store=store,
        dataset_size=dataset_size,
        batch_size=batch_size,
        seed=dist.seed,
        replica=replica,
        quorum_retries=quorum_retries,
        quorum_every=quorum_every,
    )
    manager.register_state_dict_fn("faccel", ft.load, ft.capture)
    # A state restored from a checkpoint starts at its step: a replica behind it heals from it.
    manager.load_state_dict({"step": state.step, "batches_committed": 0})
    ft.live = state
    dist.runtime.at_close(_HOOK, ft.close)
    return ft


def _zero(state: TrainState) -> None:
    for p in state.model.parameters():
        p.grad = None


def replica_quorum(ft: FaultTolerance, state: TrainState) -> ReplicaQuorum:
    """Begin a step: agree on the replicas alive now, heal this one if it is behind.

    Call it before the forward pass; read ``quorum.indices`` and step from ``quorum.state``.
    Gradients are cleared here (a discarded step's must not leak into the next). With
    ``quorum_every`` above 1, a step between quorums goes on with the last quorum's
    participants without asking torchft (``quorum.fresh`` is false).

    Raises:
        DistributedError: No quorum formed within the timeout (the lighthouse is
            unreachable, or fewer than ``min_replicas`` replicas are alive).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> ft = FaultTolerance(manager=None, pg=None, store=None, dataset_size=8, batch_size=2, seed=0)
        >>> ft.closed = True
        >>> replica_quorum(ft, state)
        Traceback (most recent call last):
        ...
        faccel.errors.UsageError: replica_quorum after the replica was closed: ...
    """
    if ft.closed:
        msg = "replica_quorum after the replica was closed: make a new one with fault_tolerant"
        raise UsageError(msg)
    manager = ft.manager
    ft.live = state
    ft.healed = False
    _zero(state)
    fresh = quorum_due(step=state.step, quorum_at=ft.quorum_at, every=ft.quorum_every)
    retries = 0
    if fresh:
        retries = _start_quorum(ft)
        state = ft.live
        ft.quorum_at = state.step
    failed = manager.errored() is not None
    participants = max(manager.num_participants(), 1)
    rank = manager.participating_rank() if not failed else 0
    rank = 0 if rank is None else rank
    counts = sample_counts(
        consumed=state.consumed,
        dataset_size=ft.dataset_size,
        batch_size=ft.batch_size,
        participants=participants,
    )
    rows = replica_rows(
        epoch=state.epoch,
        consumed=state.consumed,
        dataset_size=ft.dataset_size,
        batch_size=ft.batch_size,
        replica_rank=rank,
        participants=participants,
    )
    order = ft.order(state.epoch)
    return ReplicaQuorum(
        state=state,
        quorum_id=quorum_id(manager),
        replica_rank=rank,
        participants=participants,
        rows=rows,
        indices=tuple(order[rows.start : rows.stop].tolist()),
        counts=tuple(counts),
        healed=ft.healed,
        failed=failed,
        retries=retries,
        fresh=fresh,
    )


def _start_quorum(ft: FaultTolerance) -> int:
    """torchft's quorum for this step, asked for again while one does not form; the retries it took.

    A quorum that does not form within the timeout is not this replica's failure: the
    lighthouse waits for every replica it still hears, and after a death the others can
    be held for a timeout or more (a collective with the dead replica, a rebuild of the
    process group it never joined, a transfer to it). This replica asks again, up to
    ``ft.quorum_retries`` times, and then raises: the lighthouse is gone, or fewer than
    ``min_replicas`` replicas stayed alive that long. A rebuild or a transfer that failed
    inside a quorum does not come here: torchft reports it, the step is discarded, and
    the next quorum (whose number the failure changes) rebuilds the group.
    """
    manager = ft.manager
    attempt = 0
    while True:
        try:
            manager.start_quorum()
            return attempt
        except Exception as error:  # torchft raises whatever its RPC raised
            forget_quorum(manager)
            if attempt == ft.quorum_retries:
                msg = (
                    f"replica {ft.replica}: no quorum formed in {attempt + 1} tries of quorum_timeout each "
                    f"({error}); is the lighthouse running, and are min_replicas replicas alive?"
                )
                raise DistributedError(msg) from error
            attempt += 1
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            logging.getLogger("faccel.fault_tolerance").warning(
                "replica %d: no quorum formed (%s); asking again (retry %d of %d)",
                ft.replica,
                first_line,
                attempt,
                ft.quorum_retries,
            )


def advance(state: TrainState, taken: int, dataset_size: int) -> TrainState:
    """The state after a committed step that read ``taken`` positions of the epoch's order.

    Example:
        >>> import torch
        >>> s = TrainState.create(model=torch.nn.Linear(1, 1), optimizer=None)
        >>> s = advance(advance(s, 6, 10), 4, 10)
        >>> s.step, s.epoch, s.consumed
        (2, 1, 0)
    """
    consumed = state.consumed + taken
    epoch = state.epoch
    if consumed >= dataset_size:
        epoch, consumed = epoch + 1, 0
    return attrs.evolve(state, step=state.step + 1, epoch=epoch, position=0, resumed_at=(epoch, consumed))


def apply_step(state: TrainState, grads: list[torch.Tensor], counts: tuple[int, ...]) -> None:
    """The optimizer step of a committed step: the combined gradient into ``.grad``, then step.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(1, 1, bias=False)
        >>> s = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        >>> with torch.no_grad():
        ...     _ = model.weight.fill_(1.0)
        >>> apply_step(s, [torch.tensor([1.0]), torch.tensor([3.0])], (2, 2))
        >>> model.weight.item()
        -1.0
    """
    params = [p for p in state.model.parameters() if p.requires_grad]
    set_flat_grads(params, combine(grads, counts))
    if state.optimizer is not None:
        state.optimizer.step()
    if state.scheduler is not None:
        state.scheduler.step()
    _zero(state)


def replica_commit(ft: FaultTolerance, quorum: ReplicaQuorum) -> TrainState:
    """End a step: combine the replicas' gradients and step, or discard the step.

    Call it after ``backward`` (with no optimizer step of your own). The gradients of
    the participants are gathered and combined as the mean over the step's samples
    (with full batches: their sum divided by ``quorum.participants``); the commit vote
    (torchft's ``should_commit``, decided in this process: ``_manager.py``) then
    decides. Committed: the optimizer (and scheduler) step, and the returned state has
    ``step + 1`` and the data position moved past the step's samples. Discarded (a
    replica failed in the step): gradients cleared, the state returned unchanged; the
    next :func:`replica_quorum` asks for a quorum (whatever ``quorum_every`` says) and
    goes on with the replicas left, and the same samples are read again.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(2, 1)
        >>> state = TrainState.create(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
        >>> rows = replica_rows(epoch=0, consumed=0, dataset_size=8, batch_size=2, replica_rank=0,
        ...                     participants=1)
        >>> quorum = ReplicaQuorum(state=state, quorum_id=1, replica_rank=0, participants=1, rows=rows,
        ...                        indices=(3, 5), counts=(2,), healed=False, failed=False)
        >>> ft = FaultTolerance(manager=None, pg=None, store=None, dataset_size=8, batch_size=2, seed=0)
        >>> ft.closed = True
        >>> replica_commit(ft, quorum)
        Traceback (most recent call last):
        ...
        faccel.errors.UsageError: replica_commit after the replica was closed: ...
    """
    if ft.closed:
        msg = "replica_commit after the replica was closed: make a new one with fault_tolerant"
        raise UsageError(msg)
    manager = ft.manager
    state = quorum.state
    params = [p for p in state.model.parameters() if p.requires_grad]
    flat = flat_grads(params)
    gathered = [torch.empty_like(flat) for _ in range(quorum.participants)]
    if manager.errored() is None:
        try:
            ft.pg.allgather([gathered], [flat], AllgatherOptions()).wait()
        except Exception as error:  # a peer died in the collective: gloo raises what the socket said
            manager.report_error(error)
    if not commit_alone(manager):
        _zero(state)
        ft.live = state
        ft.quorum_at = None  # the next step asks for a quorum, whatever quorum_every says
        return state
    apply_step(state, gathered, quorum.counts)
    state = advance(state, quorum.rows.taken, ft.dataset_size)
    ft.live = state
    return state
