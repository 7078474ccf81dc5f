"""The runtime handle: what one process owns while it trains, in one object you can see and close.

faccel keeps no module-level mutable state. What a process must hold
between calls lives in one :class:`Runtime`, made with its
:class:`~faccel.DistState` (:func:`faccel.detect` makes one per call; so does
``DistState(...)`` and ``DistState.simulated(...)``), carried by it as
``dist.runtime`` outside equality, hashing and ``repr`` (two states that say
the same facts are equal whatever they hold), shared by the states
``attrs.evolve`` derives from it, and closed by :func:`faccel.shutdown`:

- the background checkpoint (``checkpoint(..., blocking=False)``) still being
  written, on a :class:`CheckpointThread` that knows this handle (another
  handle's checkpoint waits for it, found by type and owner, not by a thread
  name), and the host staging buffers it copies into, kept for reuse (a copy
  into pages already mapped runs at memory speed) until
  :func:`faccel.free_memory` or ``shutdown`` releases them;
- the DeviceMeshes and subgroups made for the layouts (a DTensor's mesh must be
  the very mesh the next call slices from);
- the hooks ``shutdown`` runs first;
- the hooks faccel registered on your objects (the evaluation check-in of a
  sharded model, the optimizer's look at its parameters before its first
  step; each listed, with why, in ``faccel._marks``), removed by ``shutdown``;
- the process groups faccel made for itself (the evaluation check-in's gloo
  group: one per handle, however many models are prepared), dropped by
  ``shutdown`` before the process group stops;
- exact mode's gradient buffers for each model (``micro_batches(..., atoms=)``),
  kept from one iteration to the next;
- the record of each prepared loader's iterations, weakly keyed by its
  ``DataLoader`` (:class:`LoaderRecord`: the guards against a second bare pass
  and against re-reading an epoch resumed at another world size; see
  docs/data.md);
- the checkpoint roots this process has written into (the first ``checkpoint``
  into a root refuses one that already holds later steps, at once rather than
  at the first collision);
- a bounded breadcrumb of this rank's last faccel calls (:class:`Crumb`), which
  a rank publishes to the process group's store when it enters a collective,
  so that a rank whose collective times out can name the ranks that did not
  arrive and what each was last doing;
- the phase of the step this rank is in (``forward``, ``backward``,
  ``optimizer``, ``checkpoint``: :meth:`Runtime.enter`) and the time it
  entered its last backward (the meter's ``forward_seconds``), and, where
  :func:`faccel.init_tracker` gave a local logdir to a run of several ranks,
  the folder of hang records and the thread that keeps this rank's record
  there up to date (``faccel._dist._hangs``), stopped by ``shutdown``.

A copy of a ``DistState`` in another process (pickled by a ``multiprocessing``
harness) gets a fresh, empty handle: resources do not travel.
"""

from __future__ import annotations

import collections
import datetime
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from faccel._dist._hangs import WRITE_SECONDS, HangRecord, here, now, write_record
from faccel._torch_compat import set_group_timeout

__all__ = ["CheckpointThread", "Crumb", "LoaderRecord", "Pending", "Runtime"]

# How many of the last faccel calls a rank remembers (a hang report names the last one).
CRUMBS = 8


@attrs.frozen
class Crumb:
    """One faccel call this rank entered: its name, its number among this rank's collectives, the step.

    ``step`` is the last training step faccel saw on this rank (the
    ``TrainState.step`` passed to ``checkpoint`` or ``restore``), None before
    any; ``backwards`` counts this rank's :func:`faccel.backward` calls.
    """

    call: str
    number: int
    step: int | None
    backwards: int = 0

    def text(self) -> str:
        """The crumb as published to the store: ``number|call|step|backwards``."""
        return f"{self.number}|{self.call}|{'' if self.step is None else self.step}|{self.backwards}"

    @classmethod
    def parse(cls, text: str) -> Crumb | None:
        """The crumb :meth:`text` wrote; None for anything else.

        Example:
            >>> Crumb.parse(Crumb(call="reduce", number=3, step=7, backwards=2).text())
            Crumb(call='reduce', number=3, step=7, backwards=2)
        """
        parts = text.split("|")
        if len(parts) != 4 or not parts[0].isdigit() or not parts[3].isdigit():
            return None
        step = int(parts[2]) if parts[2].lstrip("-").isdigit() else None
        return cls(call=parts[1], number=int(parts[0]), step=step, backwards=int(parts[3]))

    def describe(self) -> str:
        """``reduce() (collective #3), at step 7, after 2 backward calls``."""
        step = "before any step faccel saw" if self.step is None else f"at step {self.step}"
        return f"{self.call}() (its collective #{self.number}), {step}, after {self.backwards} backward calls"


@attrs.define
class Pending:
    """The one background checkpoint of a process: its thread, and its error once it failed."""

    step: int
    thread: threading.Thread
    error: BaseException | None = None


class CheckpointThread(threading.Thread):
    """A background checkpoint's thread; it knows the runtime handle that started it.

    Another handle of the same process (a second ``detect``) must let it finish
    before it writes: :meth:`Runtime.others_writing` finds it by its type and
    owner, not by a thread name.
    """

    def __init__(self, owner: Runtime, target: Callable[[], None]) -> None:
        super().__init__(target=target, name="faccel-checkpoint", daemon=False)
        self.owner: weakref.ReferenceType[Runtime] = weakref.ref(owner)


@attrs.define
class LoaderRecord:
    """What this process did with one prepared loader: the facts its guards need.

    Attributes:
        started: Iterations started over all views (with persistent workers the
            ``DataLoader`` has one iterator, which each new iteration resets).
        bare_iterated: Whether the view ``prepare`` returned has been iterated.
        due: The ``(epoch, consumed)`` a restore at another world size left to
            resume from, until a view of that epoch that skips ``consumed`` is read.
    """

    started: int = 0
    bare_iterated: bool = False
    due: tuple[int, int] | None = None


def _fresh() -> Runtime:
    return Runtime()


class Runtime:
    """The resources of one process's run; see the module's docstring. Closed by :func:`faccel.shutdown`.

    Example:
        >>> import faccel
        >>> dist = faccel.detect({})
        >>> dist.runtime is faccel.detect({}).runtime    # each detect makes its own
        False
        >>> dist.runtime.note("prepare").call
        'prepare'
    """

    def __init__(self) -> None:
        self.pending: Pending | None = None
        self.staging: dict[str, dict[str, torch.Tensor]] = {}
        self.meshes: dict[tuple[Any, ...], tuple[Any, Any]] = {}
        self.hooks: dict[str, Callable[[], None]] = {}
        # Hooks on the user's objects (torch's RemovableHandle, by its id): removed by close.
        self.handles: dict[int, Any] = {}
        # Process groups faccel made for its own use, by name (faccel._marks.GROUPS): dropped by close.
        self.groups: dict[str, Any] = {}
        self.crumbs: collections.deque[Crumb] = collections.deque(maxlen=CRUMBS)
        self.loaders: weakref.WeakKeyDictionary[Any, LoaderRecord] = weakref.WeakKeyDictionary()
        # Exact mode's gradient buffers, weakly keyed by the model: every micro_batches(..., atoms=)
        # iteration reuses them (pages already mapped) rather than allocating its own.
        self.exact: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        # Expert parallelism's load in the last forward of each experts module, by its name:
        # (tokens routed to each expert, assignments dropped) (faccel._loop._strategies._experts).
        self.expert_loads: dict[str, tuple[torch.Tensor, int]] = {}
        # The loop strategy chosen for the last DistState that asked (faccel._loop._strategies), by
        # identity: a DistState is frozen, so the choice holds for it, and the per-step calls
        # (backward, clipping) skip the walk over the table. Weak, so the record is not kept alive.
        self.chosen: tuple[weakref.ref[Any], Any] | None = None
        self.collectives = 0  # collectives this rank entered: the number a crumb carries
        self.step: int | None = None
        self.backwards = 0  # backward calls: a crumb says how far training had got
        # This rank told its peers it failed inside a collective region (faccel._dist._region): the
        # next region it completes takes the word back, so a later loss is not blamed on it.
        self.announced = False
        self.timeout: datetime.timedelta | None = None  # the train_timeout, once applied
        # The checkpoint roots this process has written into: the first checkpoint into any
        # other root checks, at once, that the root holds no later steps this run would meet.
        self.roots: set[str] = set()
        # The phase of the step (enter()), and when this rank last entered backward (perf_counter).
        self.phase = "setup"
        self.backward_at = 0.0
        # Hang records (faccel._dist._hangs): the folder, this rank's identity, the writer thread.
        self.hangs: Path | None = None
        self.identity: tuple[int, int] = (0, 0)  # (rank, local rank)
        self.written: tuple[Any, ...] = ()  # what the last record said: written again only on change
        self.recorder: threading.Thread | None = None
        self.stop_recording = threading.Event()

    def warm_up(self, timeout: datetime.timedelta) -> None:
        """Shorten the collectives' timeout to ``timeout``: the default group's and the meshes' groups'.

        Called once, by ``backward``, when ``DistState.train_timeout`` is set and
        the first optimizer step is done (torchtitan's warm-up timeout).
        """
        self.timeout = timeout
        import torch.distributed as tdist

        if not tdist.is_initialized():
            return
        groups: list[Any] = [tdist.group.WORLD]
        for _, made in self.meshes.values():
            groups += made.get_all_groups() if hasattr(made, "get_all_groups") else [made]
        for group in groups:
            if group is not None:
                set_group_timeout(group, timeout)

    def __reduce__(self) -> tuple[Callable[[], Runtime], tuple[()]]:
        # A copy (another process, copy.deepcopy) starts empty: threads and buffers stay here.
        return (_fresh, ())

    def note(self, call: str, *, step: int | None = None, collective: bool = False) -> Crumb:
        """Remember that this rank entered ``call`` (at ``step``, if known); the crumb made."""
        if step is not None:
            self.step = step
        if collective:
            self.collectives += 1
        crumb = Crumb(call=call, number=self.collectives, step=self.step, backwards=self.backwards)
        self.crumbs.append(crumb)
        return crumb

    def enter(self, phase: str) -> None:
        """This rank is now in ``phase`` of its step (an attribute store: free in the loop)."""
        self.phase = phase

    def entered_backward(self) -> None:
        """A backward call begins: counted, its phase and time noted (the meter's forward time ends here)."""
        self.backwards += 1
        self.phase = "backward"
        self.backward_at = time.perf_counter()

    def hang_record(self, state: str = "running") -> HangRecord:
        """What this rank last entered, as its hang record says it."""
        crumb = self.last()
        rank, local_rank = self.identity
        return HangRecord(
            rank=rank,
            host=here(),
            local_rank=local_rank,
            call=crumb.call if crumb else "",
            number=self.collectives,
            phase=self.phase,
            step=self.step,
            backwards=self.backwards,
            time=now(),
            state=state,
        )

    def record_hangs(self, folder: Path, *, rank: int, local_rank: int) -> None:
        """Keep this rank's hang record in ``folder`` from now on, by a thread of this handle.

        Called by ``init_tracker`` on every rank of a run of several; a second
        call moves the records to the new folder.
        """
        folder.mkdir(parents=True, exist_ok=True)
        self.hangs, self.identity, self.written = folder, (rank, local_rank), ()
        self.write_hang_record()
        if self.recorder is None or not self.recorder.is_alive():
            self.stop_recording.clear()
            self.recorder = threading.Thread(target=self._record, name="faccel-hang-record", daemon=True)
            self.recorder.start()

    def write_hang_record(self, state: str = "running") -> None:
        """Write this rank's hang record now, if it changed (or ``state`` is not ``running``)."""
        folder = self.hangs
        if folder is None:
            return
        said = (self.phase, self.collectives, self.backwards, self.step, self.last(), state)
        if said == self.written and state == "running":
            return
        self.written = said
        write_record(folder, self.hang_record(state))

    def _record(self) -> None:
        # Wakes every WRITE_SECONDS and writes only when the phase moved on: a rank that stops
        # leaves its last phase on the disk, and a running one costs a comparison.
        while not self.stop_recording.wait(WRITE_SECONDS):
            self.write_hang_record()

    def last(self) -> Crumb | None:
        """The last call noted, or None."""
        return self.crumbs[-1] if self.crumbs else None

    def loader(self, key: Any) -> LoaderRecord:
        """The iteration record of the prepared loader reading ``key`` (its ``DataLoader``)."""
        record = self.loaders.get(key)
        if record is None:
            record = self.loaders[key] = LoaderRecord()
        return record

    def background(self, step: int, target: Callable[[], None]) -> Pending:
        """The background checkpoint of ``step`` on a :class:`CheckpointThread` of this handle, unstarted."""
        self.pending = Pending(step=step, thread=CheckpointThread(self, target))
        return self.pending

    def others_writing(self) -> list[threading.Thread]:
        """The background checkpoints still running that other handles of this process started."""
        here = threading.current_thread()
        return [
            thread
            for thread in threading.enumerate()
            if isinstance(thread, CheckpointThread) and thread.owner() is not self and thread is not here
        ]

    def at_close(self, name: str, hook: Callable[[], None]) -> None:
        """Have :meth:`close` call ``hook`` first (once per ``name``, however often it is registered)."""
        self.hooks[name] = hook

    def drop_hook(self, name: str) -> None:
        """Forget the hook registered under ``name`` (nothing if there is none)."""
        self.hooks.pop(name, None)

    def hold(self, handle: Any) -> Any:
        """Keep ``handle`` (a hook on a user's object) until :meth:`release` or :meth:`close` removes it."""
        self.handles[handle.id] = handle
        return handle

    def release(self, handle: Any) -> None:
        """Remove the hook of ``handle`` from its object, and forget it."""
        handle.remove()
        self.handles.pop(handle.id, None)

    def group(self, name: str, make: Callable[[], Any]) -> Any:
        """The process group kept under ``name``, made by ``make()`` the first time it is asked for.

        ``make`` is a collective (``torch.distributed.new_group``): every rank
        asks for the same names in the same order, as every rank makes the same
        ``prepare`` calls.
        """
        group = self.groups.get(name)
        if group is None:
            group = self.groups[name] = make()
        return group

    def release_staging(self) -> None:
        """Drop the staging buffers (the background checkpoint must be done: see ``free_memory``)."""
        self.staging.clear()

    def close(self) -> None:
        """Run the hooks, remove faccel's hooks from your objects, drop the groups, buffers and meshes.

        The handle stays usable. A hook's error is raised after the rest is released.
        """
        try:
            for hook in list(self.hooks.values()):
                hook()
        finally:
            self.hooks.clear()
            for handle in list(self.handles.values()):
                handle.remove()
            self.handles.clear()
            self.groups.clear()
            self.staging.clear()
            self.exact.clear()
            self.meshes.clear()
            self.stop_recording.set()
            if self.recorder is not None and self.recorder is not threading.current_thread():
                self.recorder.join()
            self.recorder = None
