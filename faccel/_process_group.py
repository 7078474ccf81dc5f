"""The one place that starts and stops torch.distributed's default process group."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as tdist

from faccel._state import DistState
from faccel._typecheck import setup_checked
from faccel.errors import DistributedError

__all__ = [
    "main_process_first",
    "shutdown",
    "start_process_group",
    "wait_for_everyone",
]


def start_process_group(dist: DistState) -> None:
    """Start the default process group that ``dist`` describes, once.

    Idempotent: a running group with the same rank and world size is reused;
    one that disagrees raises :class:`DistributedError`.
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
        store = tdist.TCPStore(
            host_name=dist.master_addr,
            port=dist.master_port,
            world_size=dist.world_size,
            is_master=dist.rank == 0 and not dist.external_store,
            timeout=dist.timeout,
            multi_tenant=True,
        )
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
    if dist.device.type == "cuda":
        torch.cuda.set_device(dist.device)


@setup_checked
def shutdown(dist: DistState) -> None:
    """Stop the default process group, if one runs. Safe to call more than once.

    Example:
        >>> import faccel
        >>> faccel.shutdown(faccel.detect({}))   # nothing to stop in one process
    """
    if dist.distributed and tdist.is_initialized():
        tdist.destroy_process_group()


def _require_group(dist: DistState) -> None:
    if not tdist.is_initialized():
        msg = (
            f"rank {dist.rank} of {dist.world_size} needs a running process group; "
            "create the DistState with faccel.detect() under a launcher such as torchrun"
        )
        raise DistributedError(msg)


def wait_for_everyone(dist: DistState) -> None:
    """Block until every process reaches this call. A no-op in one process.

    Example:
        >>> import faccel
        >>> wait_for_everyone(faccel.detect({}))
    """
    if not dist.distributed:
        return
    _require_group(dist)
    tdist.barrier()


@contextlib.contextmanager
def main_process_first(dist: DistState) -> Iterator[None]:
    """Run the block on the main process first, then on the others.

    For work that fills a cache (a download, a tokenised dataset) which the
    others then read. Every process must enter the block.

    Example:
        >>> import faccel
        >>> with main_process_first(faccel.detect({})):
        ...     print("built the cache")
        built the cache
    """
    if not dist.is_main_process:
        wait_for_everyone(dist)
    yield
    if dist.is_main_process:
        wait_for_everyone(dist)
