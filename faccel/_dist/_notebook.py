"""``launch``: real processes from a running interpreter or a notebook (Accelerate's ``notebook_launcher``).

The parent hosts the rendezvous store on a port the OS picks, as torchrun's
agent does, and starts ``nprocs`` children with a torchrun-like environment, so
``faccel.detect()`` inside the function finds a real gloo (or NCCL) group. The
children are forked by default: a function defined in a notebook cell cannot be
imported by a fresh interpreter, but a forked child has it. Each child sends
back its result or its traceback through a pipe of its own; the first failure
stops the others and is raised here with the failing rank's traceback.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any, cast

import torch

from faccel._typecheck import setup_checked
from faccel.errors import ArgumentValueError, DistributedError, UsageError

__all__ = ["launch"]


def _child(
    fn: Callable[..., Any],
    rank: int,
    nprocs: int,
    ports: Connection,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    pipe: Connection,
) -> None:
    port = ports.recv()  # the store's, sent once every child exists (see launch)
    ports.close()
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "GROUP_RANK": "0",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        }
    )
    try:
        result = fn(*args, **kwargs)
        pipe.send(("ok", result if rank == 0 else None))
    except BaseException:
        pipe.send(("error", traceback.format_exc()))
    finally:
        import torch.distributed as tdist

        if tdist.is_initialized():
            tdist.destroy_process_group()
        pipe.close()


def _stop(processes: Sequence[Any]) -> None:
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()


@setup_checked
def launch(
    fn: Callable[..., Any],
    *,
    nprocs: int = 2,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    start_method: str = "fork",
) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` real processes; return rank 0's result.

    Inside ``fn``, ``faccel.detect()`` starts the process group as under
    torchrun (gloo on CPU, NCCL with one GPU per process). Results and
    arguments travel between your own processes through multiprocessing
    pipes; ranks other than 0 return nothing.

    Args:
        fn: The function each rank runs (defined anywhere, a notebook cell too).
        nprocs: How many processes.
        args: Positional arguments for ``fn``.
        kwargs: Keyword arguments for ``fn``.
        timeout: Seconds to wait for all ranks; None waits as long as they run.
        start_method: ``"fork"`` (default; needs CUDA untouched in this
            process) or ``"spawn"``/``"forkserver"`` (``fn`` must be importable).

    Returns:
        What ``fn`` returned on rank 0.

    Raises:
        DistributedError: A rank raised (its traceback is in the message; the
            other ranks are stopped at once), died, or the timeout passed.
        UsageError: ``start_method="fork"`` after CUDA was initialised here.
        ArgumentValueError: ``nprocs < 1`` or an unknown start method.

    Example:
        >>> import faccel
        >>> def rank_and_size():
        ...     dist = faccel.detect()
        ...     return dist.rank, dist.world_size, faccel.reduce(dist, torch.ones(1), op="sum").item()
        >>> faccel.launch(rank_and_size, nprocs=2)
        (0, 2, 2.0)
    """
    if nprocs < 1:
        msg = f"nprocs must be >= 1, got {nprocs!r}"
        raise ArgumentValueError(msg)
    if start_method not in mp.get_all_start_methods():
        msg = f"start_method must be one of {mp.get_all_start_methods()}, got {start_method!r}"
        raise ArgumentValueError(msg)
    if start_method == "fork" and torch.cuda.is_initialized():
        msg = (
            "CUDA is already initialised in this process, and forked children cannot use it; "
            "restart the kernel and call faccel.launch before touching the GPU, or pass "
            "start_method='spawn' with a function defined in an importable module"
        )
        raise UsageError(msg)
    from torch.distributed import TCPStore

    context: Any = mp.get_context(start_method)
    pipes: dict[Connection, int] = {}
    ports: list[Connection] = []
    processes = []
    store = None
    try:
        for rank in range(nprocs):
            receive, send = context.Pipe(duplex=False)
            port_in, port_out = context.Pipe(duplex=False)
            process = context.Process(
                target=_child,
                args=(fn, rank, nprocs, port_in, tuple(args), dict(kwargs or {}), send),
                # Not daemonic: a daemonic process may not start children, and a DataLoader
                # with workers inside ``fn`` needs them. ``_stop`` below ends every child.
                daemon=False,
            )
            process.start()
            send.close()
            port_in.close()
            pipes[receive] = rank
            ports.append(port_out)
            processes.append(process)
        # The store lives here for the whole run; the children connect to it as torchrun's workers
        # do. It starts only once every child is forked: a fork while its server thread serves the
        # first ranks can copy a lock that thread holds into the next child. (Once, under two test
        # suites' load, the third of three forked ranks never reached the store; this is the one
        # thread faccel adds before the forks, so it no longer runs then.)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for out in ports:
            out.send(store.port)
            out.close()
        return _collect(processes, pipes, timeout)
    finally:
        _stop(processes)
        del store


def _collect(processes: Sequence[Any], pipes: dict[Connection, int], timeout: float | None) -> Any:
    """Rank 0's result once every rank has answered; the first failure raised at once."""
    result = None
    waiting: dict[Any, int] = dict(pipes)
    deadline = None if timeout is None else time.monotonic() + timeout
    while waiting:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(waiting), timeout=left)
        if not ready:
            running = sorted(waiting.values())
            msg = f"faccel.launch: ranks {running} still running after {timeout} s; stopped them"
            raise DistributedError(msg)
        for answered in ready:
            pipe = cast(Connection, answered)  # wait() answers with the pipes it was given
            rank = waiting.pop(pipe)
            try:
                status, value = pipe.recv()
            except EOFError:
                processes[rank].join(timeout=5)
                msg = (
                    f"faccel.launch: rank {rank} died without an answer (exit code "
                    f"{processes[rank].exitcode}); the other ranks were stopped"
                )
                raise DistributedError(msg) from None
            if status == "error":
                msg = (
                    f"faccel.launch: rank {rank} failed; the other ranks were stopped. "
                    f"Its traceback:\n{value}"
                )
                raise DistributedError(msg)
            if rank == 0:
                result = value
    return result
