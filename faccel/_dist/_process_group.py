"""The one place that talks to torch.distributed's default process group.

It starts the group (:func:`detect`) and stops it (:func:`shutdown`), and it
owns the rules every module follows before talking to peers:
:func:`require_group` and :func:`require_peers` (is there a group to talk
through, and is this state allowed to talk at all) and :func:`comm_device`
(where the tensors of a collective must live for this backend).
``faccel._dist._state`` stays pure: this module imports it, never the reverse.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as tdist

from faccel._choices import STRATEGY, Backend, Precision, Strategy
from faccel._dist._deepspeed_config import read_config
from faccel._dist._launch import OPTION_VARIABLES
from faccel._dist._layout import Layout
from faccel._dist._runtime import Crumb
from faccel._dist._settle import settle_gloo_workers
from faccel._dist._state import DistState, state_from_env
from faccel._marks import PROCESS_GROUP
from faccel._torch_compat import default_store
from faccel._typecheck import setup_checked
from faccel.errors import DistributedError, FaccelError

__all__ = [
    "breadcrumb",
    "comm_device",
    "detect",
    "last_calls",
    "local_main_process_first",
    "main_process_first",
    "peers_answer",
    "pin_process_group",
    "require_group",
    "require_peers",
    "shutdown",
    "start_process_group",
    "wait_for_everyone",
]

# Backends that move CPU tensors between processes whatever the training device is;
# the others (nccl, xccl) move tensors of the accelerator only.
_CPU_BACKENDS = frozenset({"gloo", "mpi"})


@setup_checked
def detect(
    env: Mapping[str, str] | None = None,
    *,
    device: str | torch.device | None = None,
    precision: Precision | None = None,
    backend: Backend | None = None,
    accumulation_steps: int | None = None,
    strategy: Strategy | None = None,
    seed: int = 0,
    timeout: datetime.timedelta | None = None,
    layout: Layout | str | None = None,
    deepspeed: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    start: bool = True,
    train_timeout: datetime.timedelta | None = None,
) -> DistState:
    """Read the launcher, the hardware and the options into a :class:`DistState`.

    With more than one process (and ``start=True``) the default process group
    is started once, with the backend recorded in the state; calling ``detect``
    again reuses it. Stop it with :func:`faccel.shutdown`; a group ``detect``
    started is also stopped when the interpreter exits, so a script that ends
    without ``shutdown`` exits cleanly. The environment variables it reads are
    listed in ``faccel._dist._launch.ENV_VARIABLES``.

    Args:
        env: The environment to read; ``os.environ`` when None.
        device: Force a device; by default ``cuda:LOCAL_RANK``, else ``mps``, else ``cpu``.
        precision: ``'no'``, ``'bf16'`` or ``'fp16'``; default ``$FACCEL_PRECISION`` or ``'no'``.
        backend: Force a backend; default ``nccl`` on CUDA, ``gloo`` elsewhere.
        accumulation_steps: Micro-batches per optimizer step; default
            ``$FACCEL_ACCUMULATION_STEPS`` or 1.
        strategy: ``'ddp'`` (default, or ``$FACCEL_STRATEGY``), ``'fsdp'`` to
            shard models with FSDP2 across the processes, or ``'deepspeed'``
            (DeepSpeed's ZeRO, with the ``deepspeed`` config).
        seed: Seed of the data order, the same on every rank.
        timeout: How long a collective waits for the other ranks before failing
            with a :class:`~faccel.errors.DistributedError` naming it; default
            ``$FACCEL_TIMEOUT`` seconds, else 5 minutes. Raise it when one rank
            legitimately works alone longer (a download in ``main_process_first``).
        layout: How the ranks split into replicas, shards and tensor-parallel
            groups: a :class:`Layout` or its text (``'shard=2,tensor=2'``);
            default ``$FACCEL_LAYOUT``, else the strategy's (docs/parallelism.md).
        deepspeed: Under ``strategy='deepspeed'``: the DeepSpeed config, a dict
            or the path of its JSON file (``"auto"`` values and missing ones are
            filled by ``prepare``; docs/deepspeed.md). Given without a strategy,
            it selects ``'deepspeed'``. Default: the file ``$FACCEL_DEEPSPEED_CONFIG``
            names, if set (Accelerate's ``--deepspeed_config_file``).
        start: Start the process group when the world has more than one process.
        train_timeout: A shorter ``timeout`` for every collective once training
            has warmed up (from the second optimizer step's first ``backward``
            on, when the first step's one-off work is done); default
            ``$FACCEL_TRAIN_TIMEOUT`` seconds, else None (``timeout`` throughout).
            A rank that then hangs in the loop is named sooner (docs/distributed.md).

    Returns:
        The frozen record describing this process.

    Raises:
        LaunchError: Malformed environment (names the variable and its value,
            ``FACCEL_TIMEOUT=abc`` say),
            an unknown strategy, a layout whose sizes do not multiply to the world
            size or that contradicts the strategy, or a device or backend that
            cannot serve this process.
        PrecisionError: Unknown precision.
        ArgumentError: An argument of the wrong type (``seed="0"``).
        DistributedError: The process group could not be started, or a running
            one disagrees with the environment.

    Example:
        >>> dist = detect({})            # plain `python`: one process
        >>> (dist.rank, dist.world_size, dist.launcher, dist.precision)
        (0, 1, 'none', 'no')
    """
    environment = os.environ if env is None else env
    if deepspeed is None:  # FACCEL_DEEPSPEED_CONFIG: a config file from the launcher's environment
        deepspeed = environment.get(OPTION_VARIABLES["deepspeed"]) or None
        if deepspeed is not None and strategy is None and OPTION_VARIABLES["strategy"] in environment:
            # said twice: the two must agree (a word outside the closed set is refused here already)
            strategy = STRATEGY.check(environment[OPTION_VARIABLES["strategy"]])
    state = state_from_env(
        environment,
        cuda_count=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        mps_available=torch.backends.mps.is_available(),
        device=device,
        precision=precision,
        backend=backend,
        accumulation_steps=accumulation_steps,
        strategy="deepspeed" if strategy is None and deepspeed is not None else strategy,
        seed=seed,
        timeout=timeout,
        layout=layout,
        train_timeout=train_timeout,
        deepspeed=None if deepspeed is None else read_config(deepspeed),
    )
    if start and state.distributed:
        start_process_group(state)
    return state


def start_process_group(dist: DistState) -> None:
    """Start the default process group that ``dist`` describes, once.

    Idempotent: a running group with the same rank and world size is reused.

    Raises:
        DistributedError: A running group disagrees with ``dist``, ``dist`` has
            no rendezvous address, or torch.distributed could not start the group.
    """
    if tdist.is_initialized():
        rank, world = tdist.get_rank(), tdist.get_world_size()
        if (rank, world) != (dist.rank, dist.world_size):
            msg = (
                f"a process group is already running as rank {rank} of {world}, but the "
                f"DistState says rank {dist.rank} of {dist.world_size}; call faccel.shutdown() "
                "before starting another job in this process"
            )
            raise DistributedError(msg)
        return
    if dist.master_addr is None or dist.master_port is None:
        msg = "a multi-process DistState needs master_addr and master_port to start its group"
        raise DistributedError(msg)
    try:
        # An explicit store (not init_method="env://") so the record, not os.environ,
        # decides where to meet. torchrun's agent already hosts the store: connect only.
        server = tdist.TCPStore(
            host_name=dist.master_addr,
            port=dist.master_port,
            world_size=dist.world_size,
            is_master=dist.rank == 0 and not dist.external_store,
            timeout=dist.timeout,
            multi_tenant=True,
        )
        # Each attempt under its own keys: torchrun's agent keeps its store across restarts,
        # and the keys of the attempt before would send gloo to dead peers (docs/preemption.md).
        store = tdist.PrefixStore(f"faccel/attempt{dist.attempt}", server)
        device_id = dist.device if dist.device.type == "cuda" else None
        tdist.init_process_group(
            backend=dist.backend,
            store=store,
            rank=dist.rank,
            world_size=dist.world_size,
            timeout=dist.timeout,
            device_id=device_id,
        )
    except (RuntimeError, ValueError) as error:
        msg = (
            f"could not start the {dist.backend} process group as rank {dist.rank} of "
            f"{dist.world_size} at {dist.master_addr}:{dist.master_port}: {error}"
        )
        raise DistributedError(msg) from error
    # Stopped at exit too: a script that ends without shutdown() must not leave the
    # backend's threads to die with the interpreter. Harmless after shutdown().
    atexit.register(_stop_at_exit)
    if dist.device.type == "cuda":
        torch.cuda.set_device(dist.device)


def _stop_at_exit() -> None:
    if tdist.is_initialized():
        tdist.destroy_process_group()
    # Before the interpreter finalizes: a gloo worker still freeing the last collective's
    # tensors would otherwise abort the process (faccel/_dist/_settle.py).
    settle_gloo_workers()


@setup_checked
def shutdown(dist: DistState, *, trackers: Sequence[Any] = ()) -> None:
    """Close ``dist.runtime`` and ``trackers``, then stop the default process group. Safe to call again.

    Closing the runtime handle waits for a background checkpoint (raising
    its failure once the rest is closed), removes the hooks faccel registered
    on your objects (``faccel._marks``), and releases its staging buffers, its
    own process groups and the meshes made for the layouts. Wrappers
    ``prepare`` returned may outlive it: freeing a DDP wrapper afterwards is
    safe (its group is pinned past its reducer, ``pin_process_group``).
    Last, it waits for gloo's worker threads to finish with the tensors of
    the last collectives, so that the process can end at once (a worker
    still freeing one when Python finalizes would abort the process).

    Args:
        dist: The run's :class:`DistState`.
        trackers: Trackers from :func:`faccel.init_tracker` to close first
            (as :func:`faccel.end_training` does).

    Raises:
        ArgumentError: ``dist`` is not a :class:`DistState`.
        CheckpointError: A non-blocking checkpoint (``checkpoint(...,
            blocking=False)``), which this waits for, failed.

    Example:
        >>> import tempfile, faccel
        >>> dist = faccel.detect({})
        >>> faccel.shutdown(dist, trackers=[faccel.init_tracker(dist, tempfile.mkdtemp())])
    """
    # In the order torch needs with wrappers still alive: faccel's own holds go first (its hooks
    # leave your objects, its groups and meshes are dropped, a non-blocking checkpoint commits or
    # raises), the device finishes its queued work, then the groups are destroyed. A DDP wrapper
    # prepare made keeps its group pinned past its reducer (pin_process_group), so freeing it
    # later never joins gloo's threads while holding the interpreter lock.
    try:
        dist.runtime.close()
    finally:  # its failure is raised once the trackers are closed and the group is stopped
        for tracker in trackers:
            tracker.__exit__(None, None, None)
        # Under DeepSpeed a one-process run has a one-rank group of prepare's
        # (faccel/_loop/_strategies/_deepspeed/_engine.py).
        if (dist.distributed or dist.strategy == "deepspeed") and tdist.is_initialized():
            if dist.device.type == "cuda":
                torch.cuda.synchronize(dist.device)  # no kernel of a collective left in flight
            tdist.destroy_process_group()
            atexit.unregister(_stop_at_exit)
            settle_gloo_workers()  # the script may end right after this call (_settle.py)


class _Pin:
    """Holds a process group; a copy or a pickle of what holds it gets an empty pin (groups do not travel)."""

    __slots__ = ("group",)

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def __reduce__(self) -> tuple[type[_Pin], tuple[()]]:
        return (_Pin, ())

    def __deepcopy__(self, memo: dict[int, Any]) -> _Pin:
        return _Pin()


def pin_process_group(wrapper: Any) -> None:
    """Hold ``wrapper``'s process group in its last attribute (``faccel._marks.PROCESS_GROUP``).

    A ``DistributedDataParallel`` wrapper holds its group twice: as the Python
    object ``wrapper.process_group`` (set first) and from its C++ reducer (set
    later). Freeing the wrapper releases its attributes in the order they were
    set, so the reducer would drop the last hold on a group that
    :func:`shutdown` destroyed, inside a release that keeps the interpreter
    lock, and the gloo group's destructor joins its worker threads there. A
    worker still freeing the tensors of the last collective needs that lock:
    the process never exits (issue 35.11). Pinned after the reducer, the last
    hold is this Python object, which torch releases without the lock.

    Example:
        >>> import torch
        >>> wrapper = torch.nn.Linear(1, 1)
        >>> object.__setattr__(wrapper, "process_group", "a group")
        >>> pin_process_group(wrapper)
        >>> list(vars(wrapper))[-1], vars(wrapper)["_faccel_process_group"].group
        ('_faccel_process_group', 'a group')
    """
    object.__setattr__(wrapper, PROCESS_GROUP, _Pin(getattr(wrapper, "process_group", None)))


def _crumb_key(rank: int) -> str:
    return f"faccel/crumb/rank{rank}"


def _default_store() -> Any:
    try:
        return default_store()
    except (RuntimeError, ValueError):  # no group, or one started without a store
        return None


def breadcrumb(dist: DistState, call: str, *, step: int | None = None, collective: bool = False) -> None:
    """Note ``call`` in ``dist.runtime``'s breadcrumb, and publish it to the group's store.

    One small ``store.set`` (a round trip to the store's host) where a process
    group runs: called at set-up calls, checkpoints and collective entry, never
    per batch. A peer whose collective times out reads it to say what this rank
    was last doing.

    Example:
        >>> import faccel
        >>> dist = faccel.detect({})
        >>> breadcrumb(dist, "prepare")
        >>> dist.runtime.last().call
        'prepare'
    """
    crumb = dist.runtime.note(call, step=step, collective=collective)
    if dist.distributed and tdist.is_initialized():
        store = _default_store()
        if store is not None:
            store.set(_crumb_key(dist.rank), crumb.text())


def last_calls(dist: DistState, ranks: Sequence[int]) -> str:
    """``ranks``' last faccel calls, as published to the store: ``"; rank 1 was last in ..."``.

    Empty where no group runs or the store cannot say.

    Example:
        >>> import faccel
        >>> last_calls(faccel.detect({}), [1])
        ''
    """
    store = _default_store() if dist.distributed and tdist.is_initialized() else None
    if store is None:
        return ""
    said: list[str] = []
    try:
        for rank in ranks:
            key = _crumb_key(rank)
            crumb = Crumb.parse(store.get(key).decode(errors="replace")) if store.check([key]) else None
            if crumb is not None:
                said.append(f"rank {rank} was last in {crumb.describe()}")
    except RuntimeError:  # the store's host is gone
        return ""
    return "; " + "; ".join(said) if said else ""


def _absent(dist: DistState, mine: Crumb | None) -> str:
    """Which ranks did not reach this rank's collective, and their last calls, as the store says."""
    store = _default_store()
    if store is None or mine is None:
        return ""
    late: list[str] = []
    try:
        for rank in range(dist.world_size):
            if rank == dist.rank:
                continue
            key = _crumb_key(rank)
            if not store.check([key]):
                late.append(f"rank {rank} (no faccel call of it seen yet)")
                continue
            crumb = Crumb.parse(store.get(key).decode(errors="replace"))
            if crumb is None:
                continue
            if crumb.number < mine.number or (crumb.number == mine.number and crumb.call != mine.call):
                late.append(f"rank {rank} (its last faccel call: {crumb.describe()})")
    except RuntimeError:  # the store itself is gone (its host died): say nothing more
        return ""
    if not late:
        return ""
    return (
        f" The ranks that did not arrive at this {mine.call}() (this rank's collective "
        f"#{mine.number}): {'; '.join(late)}."
    )


def require_group(dist: DistState, name: str) -> None:
    """Raise unless the default process group runs: ``name()`` is about to use it.

    Raises:
        DistributedError: No process group is running in this process.

    Example:
        >>> import faccel
        >>> require_group(faccel.DistState(world_size=2, launcher="torchrun"), "barrier")
        Traceback (most recent call last):
        ...
        faccel.errors.DistributedError: barrier() on rank 0 of 2 needs a running process group; ...
    """
    if not tdist.is_initialized():
        msg = (
            f"{name}() on rank {dist.rank} of {dist.world_size} needs a running process group; "
            "create the DistState with faccel.detect() under a launcher such as torchrun, "
            "which starts it"
        )
        raise DistributedError(msg)


def require_peers(dist: DistState, name: str) -> None:
    """Raise unless ``name()`` may talk to the other ranks of ``dist``.

    One process (world size 1) passes: it has nothing to say. Real peers pass
    when the group runs. A simulated state with several ranks never passes: it
    plans as one rank of a larger job, but there are no peers to talk to.

    Raises:
        DistributedError: ``dist`` is simulated with more than one rank, or no
            process group is running.

    Example:
        >>> import faccel
        >>> require_peers(faccel.DistState.simulated(world_size=1), "gather")   # alone: fine
        >>> require_peers(faccel.DistState.simulated(rank=1, world_size=4), "gather")
        Traceback (most recent call last):
        ...
        faccel.errors.DistributedError: gather() needs the other ranks, but this DistState is simulated ...
    """
    if dist.distributed:
        require_group(dist, name)
    elif dist.world_size > 1:
        msg = (
            f"{name}() needs the other ranks, but this DistState is simulated (rank {dist.rank} of "
            f"{dist.world_size}, no peer processes): a state simulated with world_size="
            f"{dist.world_size} plans as that rank but has no process group; run under a launcher "
            "such as torchrun and make the state with faccel.detect(), or test with "
            "DistState.simulated(world_size=1)"
        )
        raise DistributedError(msg)


def comm_device(dist: DistState) -> torch.device:
    """Where a collective's tensors must live for ``dist``'s backend.

    gloo and MPI move CPU tensors (whatever the training device); NCCL and the
    other accelerator backends move tensors of ``dist.device`` only.

    Example:
        >>> import faccel
        >>> str(comm_device(faccel.DistState(backend="gloo", device="cpu")))
        'cpu'
        >>> str(comm_device(faccel.DistState(backend="nccl", device="cuda:1")))
        'cuda:1'
    """
    return torch.device("cpu") if dist.backend in _CPU_BACKENDS else dist.device


@contextlib.contextmanager
def peers_answer(dist: DistState, name: str) -> Iterator[None]:
    """Re-raise torch.distributed's report of a silent or crashed peer as a named DistributedError.

    Wraps one collective, ``name()``: gloo reports a timeout or a lost peer as
    a bare ``RuntimeError`` (``Timed out waiting 300000ms for recv operation``);
    the error raised instead names the collective, this rank and the timeout,
    and keeps torch's error as its cause. faccel's own errors pass through.
    On entry it notes ``name`` in the breadcrumb (:func:`breadcrumb`); after a
    timeout the error also names, from the store, each rank that did not reach
    this collective and its last faccel call and step.

    Raises:
        DistributedError: The block raised a ``RuntimeError`` that is not a faccel error.

    Example:
        >>> import faccel
        >>> with peers_answer(faccel.DistState(world_size=2, rank=1), "gather"):
        ...     raise RuntimeError("Timed out waiting 300000ms for recv operation to complete")
        Traceback (most recent call last):
        ...
        faccel.errors.DistributedError: gather() on rank 1 of 2 timed out after 0:05:00: ...
    """
    breadcrumb(dist, name, collective=True)
    try:
        yield
    except RuntimeError as error:  # gloo and NCCL report a lost or timed-out peer this way
        if isinstance(error, FaccelError):
            raise
        where = f"{name}() on rank {dist.rank} of {dist.world_size}"
        timeout = dist.runtime.timeout or dist.timeout  # the train_timeout, once warmed up
        if "timed out" in str(error).lower():
            msg = (
                f"{where} timed out after {timeout}: another rank did not reach {name}() "
                f"in time (it is hung, still working alone, or calling another collective)."
                f"{_absent(dist, dist.runtime.last())} Every "
                f"rank must call {name}() in the same order; if one rank legitimately works "
                "alone for longer, raise the timeout with faccel.detect(timeout=...) or "
                f"FACCEL_TIMEOUT=<seconds>. torch said: {error}"
            )
        else:
            msg = (
                f"{where} failed: {error}\nAnother rank probably crashed or did not reach this "
                f"collective within the timeout ({dist.timeout}, set with faccel.detect(timeout=...) "
                "or FACCEL_TIMEOUT); its log holds the first error"
            )
        raise DistributedError(msg) from error


def _barrier(dist: DistState, name: str) -> None:
    require_group(dist, name)
    with peers_answer(dist, name):
        tdist.barrier()


def wait_for_everyone(dist: DistState) -> None:
    """Block until every process reaches this call. A no-op in one process.

    Raises:
        DistributedError: Peer processes exist but no process group is running,
            or another rank did not arrive within ``dist.timeout`` (the message
            names ``wait_for_everyone``, this rank and the timeout).

    Example:
        >>> import faccel
        >>> wait_for_everyone(faccel.detect({}))
    """
    if dist.distributed:
        _barrier(dist, "wait_for_everyone")


@contextlib.contextmanager
def main_process_first(dist: DistState) -> Iterator[None]:
    """Run the block on the main process first, then on the others.

    For work that fills a cache (a download, a tokenised dataset) which the
    others then read. Every process must enter the block.

    Raises:
        DistributedError: As :func:`wait_for_everyone`, naming ``main_process_first``:
            the main process's block took longer than ``dist.timeout`` (raise it
            for a long download), or a rank did not enter the block.

    Example:
        >>> import faccel
        >>> with main_process_first(faccel.detect({})):
        ...     print("built the cache")
        built the cache
    """
    if dist.distributed and not dist.is_main_process:
        _barrier(dist, "main_process_first")
    yield
    if dist.distributed and dist.is_main_process:
        _barrier(dist, "main_process_first")


@contextlib.contextmanager
def local_main_process_first(dist: DistState) -> Iterator[None]:
    """Run the block on each node's main process first (``local_rank`` 0), then on the others.

    For a cache on each node's own disk (a download into local storage, a
    tokenised dataset under ``/tmp``): one process per node fills it, the
    node's others then read it. Every process must enter the block
    (Accelerate's ``accelerator.local_main_process_first()``).

    Raises:
        DistributedError: As :func:`main_process_first`, naming ``local_main_process_first``.

    Example:
        >>> import faccel
        >>> with local_main_process_first(faccel.detect({})):
        ...     print("built this node's cache")
        built this node's cache
    """
    if dist.distributed and not dist.is_local_main_process:
        _barrier(dist, "local_main_process_first")
    yield
    if dist.distributed and dist.is_local_main_process:
        _barrier(dist, "local_main_process_first")
