"""What faccel asks of torchft's ``Manager`` beyond its public calls, in one place.

torchft 0.2's manager is written for replica groups of many ranks; faccel's replica is one
process (:func:`faccel.fault_tolerant` refuses more). Three things follow, each reaching
into the manager's private state, all of them here so that a torchft upgrade has one file
to check (``tests/test_fault_tolerance.py`` checks the names it relies on):

* **The commit vote of a one-rank group is the rank's own.** ``Manager.should_commit``
  asks torchft's manager server to combine the votes of the group's ranks (a gRPC round
  trip, about 0.3 ms alone and 0.7 ms inside a step on 2 CPU cores); the server keeps no
  other state on the way (``src/manager.rs``: a vote count, reset at each decision). With
  one rank the decision is the local vote, so :func:`commit_alone` decides it here, with
  the same bookkeeping ``should_commit`` does after the round trip.
* **A quorum request that raised is forgotten** (:func:`forget_quorum`): torchft keeps its
  future and raises it again at the next ``start_quorum``.
* **The quorum's number** (:func:`quorum_id`): torchft does not expose it.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["commit_alone", "forget_quorum", "quorum_id"]


def commit_alone(manager: Any) -> bool:
    """torchft's ``should_commit`` for a group of one rank: the local vote, without the round trip.

    The step is committed when the process group saw no error, no error was reported in
    the step, and enough replicas take part; the manager's step and batch counters move
    on as ``should_commit`` moves them. A group of several ranks goes to torchft.

    Example:
        >>> class Group:
        ...     def errored(self): return None
        >>> class Manager:  # the attributes torchft 0.2's Manager has, at rest
        ...     _group_world_size, _recovery_event, _healing, _errored = 1, None, False, None
        ...     _min_replica_size, _step, _batches_committed, _commit_failures = 2, 4, 12, 0
        ...     _pg = Group()
        ...     class _checkpoint_transport:
        ...         def disallow_checkpoint(): pass
        ...     def num_participants(self): return 3
        >>> manager = Manager()
        >>> commit_alone(manager), manager._step, manager._batches_committed
        (True, 5, 15)
    """
    if manager._group_world_size != 1:
        return bool(manager.should_commit())
    # What should_commit does before its round trip: wait for a recovery in flight, let
    # the device finish, take up the process group's error, apply a received state.
    if manager._recovery_event is not None:
        manager._recovery_event.synchronize()
        manager._recovery_event = None
    if torch.accelerator.is_available():
        torch.accelerator.synchronize()
    if (error := manager._pg.errored()) is not None:
        manager.report_error(error)
    if manager._healing:
        manager._apply_pending_state_dict()
    participants = manager.num_participants()
    commit = participants >= manager._min_replica_size and manager._errored is None
    manager._checkpoint_transport.disallow_checkpoint()
    # And after it: the counters (faccel leaves torchft's max_retries unset, so a run of
    # discarded steps raises nothing here; faccel's quorum retries bound a dead job).
    if commit:
        manager._step += 1
        manager._batches_committed += participants
        manager._commit_failures = 0
    else:
        manager._commit_failures += 1
    return commit


def forget_quorum(manager: Any) -> None:
    """Drop the future of a quorum request that raised, so that the next request is a new one.

    Example:
        >>> class Manager:
        ...     _quorum_future = "a failed request"
        >>> manager = Manager()
        >>> forget_quorum(manager)
        >>> manager._quorum_future is None
        True
    """
    manager._quorum_future = None


def quorum_id(manager: Any) -> int:
    """torchft's number of the quorum this replica is in (-1 before the first).

    Example:
        >>> class Manager:
        ...     _quorum_id = 3
        >>> quorum_id(Manager())
        3
    """
    return int(getattr(manager, "_quorum_id", -1))
