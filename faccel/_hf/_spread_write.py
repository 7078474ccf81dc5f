"""A sharded model's ``save_model`` on one rank: gather each tensor whole, write only its own.

Every rank walks the tensors in one order (the plan's, ``_hf/_assign.py``),
because gathering a DTensor whole (``full_tensor()``) is a collective that
every rank of its mesh must enter, in the same order. Each gathered tensor is
dropped at once by every rank but its writer, which hands it to a writer
thread that streams it into the rank's own safetensors files (header first,
then each tensor's bytes, as ``python -m faccel consolidate`` writes). The
gathering goes on while the thread writes, so the ranks' disks work at the
same time, but at most ``buffer`` bytes of gathered tensors wait for the
thread (one tensor always may): a rank holds the tensor being gathered, the
ones waiting, and the one being written, never the whole model.

Why ``full_tensor()`` for every rank, not a gather onto the writer alone: a
``gather`` of the local shards to one rank saves the other ranks one
transient tensor and the network (world - 1) / world of the bytes, but the
writer would have to put the pieces together itself for each placement
(FSDP2's uneven ``Shard(0)``, tensor parallelism's ``Shard(1)``, HSDP's
replicas). ``full_tensor()`` is torch's own, correct for any mesh, and its
extra memory on a non-writer is one tensor, freed at once.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from faccel._storage._roots import spot_of
from faccel._storage._safetensors import raw_bytes
from faccel._storage._store import Spot
from faccel._torch_compat import is_dtensor

__all__ = ["OwnFile", "write_own"]

# Gathered tensors that may wait for the writer thread, in bytes (one tensor always may).
BUFFER = 64 << 20


@attrs.frozen(kw_only=True)
class OwnFile:
    """One file this rank writes: its final name, its header, and its tensors in file order."""

    name: str
    header: bytes
    names: tuple[str, ...]


class _Writer:
    """A thread that writes ``files`` from tensors handed to it in their order, ``buffer`` bytes ahead.

    After its first error it writes nothing more but still takes what it is
    handed (the walk's collectives go on to the end on every rank).
    """

    def __init__(self, directory: Spot, files: Sequence[OwnFile], buffer: int) -> None:
        self.directory = directory
        self.files = files
        self.buffer = buffer
        self.error: BaseException | None = None
        self._queue: deque[torch.Tensor | None] = deque()
        self._waiting = 0  # bytes handed over and not yet written
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="faccel-save-model", daemon=True)
        self._thread.start()

    def put(self, tensor: torch.Tensor | None) -> None:
        """Hand over the next tensor (None: no more); blocks while ``buffer`` bytes wait."""
        size = 0 if tensor is None else tensor.numel() * tensor.element_size()
        with self._ready:
            while self._waiting and self._waiting + size > self.buffer and self.error is None:
                self._ready.wait()
            self._queue.append(tensor)
            self._waiting += size
            self._ready.notify_all()

    def _next(self) -> torch.Tensor | None:
        with self._ready:
            while not self._queue:
                self._ready.wait()
            return self._queue.popleft()

    def _done(self, tensor: torch.Tensor) -> None:
        with self._ready:
            self._waiting -= tensor.numel() * tensor.element_size()
            self._ready.notify_all()

    def _run(self) -> None:
        try:
            store = self.directory.store
            for file in self.files:
                # Appears under its name whole or not at all (on a disk: .tmp-NAME, then a rename).
                with store.publisher((self.directory / file.name).key) as out:
                    out.write(file.header)
                    for _ in file.names:
                        tensor = self._next()
                        if tensor is None:  # the walk stopped early: its error is raised there
                            return
                        if tensor.numel():
                            out.write(raw_bytes(tensor))
                        self._done(tensor)
                        del tensor
                    out.close()
            store.sync_folder(self.directory.key)
        except BaseException as error:
            with self._ready:
                self.error = error
                self._ready.notify_all()
            while (tensor := self._next()) is not None:  # let the walk hand over the rest
                self._done(tensor)

    def finish(self) -> None:
        """Wait until every file is written (the walk handed over None); raise the thread's error."""
        self._thread.join()
        if self.error is not None:
            raise self.error


def _whole(tensor: Any) -> torch.Tensor:
    """The whole tensor: a DTensor gathered (a collective of its mesh), a plain one as it is."""
    with torch.no_grad():
        return tensor.full_tensor() if is_dtensor(tensor) else tensor.detach()


def write_own(
    state: Mapping[str, Any],
    walk: Sequence[str],
    owner: Mapping[str, int],
    rank: int,
    directory: Spot | Path,
    files: Sequence[OwnFile],
    *,
    buffer: int = BUFFER,
) -> None:
    """Walk ``walk`` (the same order on every rank), gathering each tensor of ``state`` whole;
    this rank's (``owner[name] == rank``) go into ``files``, its own, in that order.

    Every rank must call it (the gathers are collectives), with the same ``walk``.
    Each file is written to ``.tmp-NAME``, fsynced, and renamed to ``NAME``; then
    the folder is fsynced. A failed write (an ``OSError``) is raised after the walk
    has ended on this rank, so the other ranks' gathers are never left waiting.
    """
    writer = _Writer(spot_of(directory), files, buffer) if files else None
    try:
        for name in walk:
            whole = _whole(state[name])
            if owner[name] != rank:
                del whole  # gathered only because every rank takes part
                continue
            if writer is not None and writer.error is None:
                writer.put(whole if whole.device.type == "cpu" else whole.cpu())
            del whole
    finally:
        if writer is not None:
            writer.put(None)
    if writer is not None:
        writer.finish()
