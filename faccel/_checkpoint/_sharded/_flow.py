"""The sharded format's files (version 2): what each rank writes, the rank pages, what a rank reads.

Writing: :func:`plan_pieces` turns the model's and optimizer's tensors (FSDP2
DTensors or whole, replicated tensors) into the index (``_chunks``'s chunk
rule per tensor, the same on every rank) and the chunks this rank writes, as
views of the tensors it holds: no rank gathers another's shard. Each rank
writes ``shard-RANK.safetensors`` and ``rng-RANK.json``; their records
(size and SHA-256) travel to rank 0 in one ``all_gather`` of fixed-size byte
tensors (no pickle), and rank 0 writes them into pages of
:data:`PAGE_RANKS` ranks (``ranks-PAGE.json``), which the manifest lists.

Reading: :func:`read_tensors` computes, for each tensor the target holds,
the rows it needs (a DTensor target placed only by ``Shard(0)`` and
``Replicate``, as FSDP2 and column-parallel layers are: its local rows; any
other target: the whole tensor), opens only the shard files whose chunks
overlap them (each checked against its rank page, each page against the
manifest), and reads only those rows, every hash block checked before use.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from faccel._checkpoint._format import MODEL, OPTIMIZER, PAGE_RANKS, page_name, shard_name
from faccel._checkpoint._manifest import RankPage
from faccel._checkpoint._sharded._chunks import (
    Held,
    Placed,
    assign,
    held_rows,
    overlaps,
    parse_index,
    row_split,
    rows_of,
)
from faccel._checkpoint._sharded._shard_file import ShardFile, byte_view, empty_rows
from faccel._checkpoint._state_file import StateFile
from faccel._checkpoint._strategies import strategy_of
from faccel._checkpoint._verify import elementwise_optimizer
from faccel._dist._process_group import comm_device
from faccel._dist._state import DistState
from faccel._storage._durable import MAX_JSON, SHA256, FileRecord, allocatable_bytes, in_parallel, parse_json
from faccel._storage._roots import spot_of
from faccel._storage._store import Spot
from faccel._storage._tagged_json import decode
from faccel._torch_compat import is_dtensor
from faccel._train_state import TrainState
from faccel.errors import CheckpointError

__all__ = [
    "GROUPS",
    "allocatable_bytes",
    "exchange_records",
    "plan_pieces",
    "read_tensors",
]

# The tensor groups of a sharded checkpoint: the names state.json's tensor references use.
GROUPS = {MODEL: "model", OPTIMIZER: "optimizer"}
# Reading threads: pread and SHA-256 release the GIL.
_READERS = 4


def plan_pieces(
    files: Mapping[str, Mapping[str, torch.Tensor]],
    rank: int,
    world: int,
    held: Callable[[torch.Tensor], Held | None],
) -> tuple[dict[str, dict[str, Placed]], dict[str, torch.Tensor], dict[str, Placed]]:
    """The index ``{group: {key: Placed}}``, and the chunks ``rank`` writes, keyed ``group/key``.

    ``held`` (the strategy state's :meth:`~StrategyState.held`) says where a tensor lies when its
    strategy decides it (pipeline stages: the ranks of its stage); the others follow the chunk rule.

    Raises :class:`CheckpointError` for a DTensor that is not split by rows
    over all ranks (another layout: write it with ``sharded=False``).
    """
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    sharded: list[str] = []
    tensor: Any
    tensors: dict[str, Any] = {}
    for file, group in GROUPS.items():
        for key, value in files.get(file, {}).items():
            name, tensor = f"{group}/{key}", value
            if is_dtensor(tensor) and held(tensor) is None:
                if not row_split(tensor, world):
                    msg = (
                        f"{name} is a DTensor placed {tensor.placements} on a mesh of "
                        f"{tensor.device_mesh.mesh.tolist()}; the sharded format writes tensors split by "
                        "rows over all ranks (FSDP2's Shard(0)); checkpoint with sharded=False"
                    )
                    raise CheckpointError(msg)
                sharded.append(name)
            specs[name] = (tensor.dtype, tuple(tensor.shape))
            tensors[name] = tensor
    # Where the strategy places a tensor itself (pipeline stages: the chunk rule over its stage's
    # ranks, and the chunk this rank writes, if any).
    writers = {name: lies for name, t in tensors.items() if (lies := held(t)) is not None}
    placed = assign({k: v for k, v in specs.items() if k not in writers}, sharded, world)
    for name, lies in writers.items():
        dtype, shape = specs[name]
        placed[name] = Placed(dtype=dtype, shape=shape, block=lies.block, first=lies.first)
    placed = {name: placed[name] for name in specs}
    pieces: dict[str, torch.Tensor] = {}
    for name, spot in placed.items():
        tensor = tensors[name]
        if name in writers:
            piece = writers[name].piece()  # every rank of a stage, in one order: it may gather
            if piece is not None:
                pieces[name] = piece
            continue
        if name in sharded:
            local = tensor.to_local()
            start = min(rows_of(spot.shape), rank * spot.block)
            if local.shape[0] != min(rows_of(spot.shape), start + spot.block) - start:
                msg = f"{name}: rank {rank}'s shard has {local.shape[0]} rows, not those of an even split"
                raise CheckpointError(msg)
            if local.shape[0]:  # a rank past the last row holds no chunk
                pieces[name] = local.detach()
            continue
        for chunk in overlaps(spot, world, 0, rows_of(spot.shape)):
            if chunk.rank == rank:
                pieces[name] = (
                    tensor.detach() if not spot.shape else tensor.detach()[chunk.start : chunk.stop]
                )
    index: dict[str, dict[str, Placed]] = {group: {} for group in GROUPS.values()}
    for name, spot in placed.items():
        group, key = name.split("/", 1)
        index[group][key] = spot
    return index, pieces, placed


def _encode(record: FileRecord) -> list[int]:
    return [*record.size.to_bytes(8, "little"), *bytes.fromhex(record.digest)]


def _decode(raw: list[int]) -> FileRecord:
    return FileRecord(
        size=int.from_bytes(bytes(raw[:8]), "little"), digest=bytes(raw[8:40]).hex(), algorithm=SHA256
    )


def exchange_records(
    dist: DistState, shard: FileRecord, rng: FileRecord
) -> list[tuple[FileRecord, FileRecord]]:
    """Every rank's ``(shard, rng)`` records, on every rank: one ``all_gather`` of 80 bytes a rank."""
    mine = torch.tensor(_encode(shard) + _encode(rng), dtype=torch.uint8)
    if not dist.distributed:
        gathered = [mine]
    else:
        device = comm_device(dist)
        gathered = [torch.empty_like(mine, device=device) for _ in range(dist.world_size)]
        tdist.all_gather(gathered, mine.to(device))
    out = []
    for tensor in gathered:
        values = tensor.cpu().tolist()
        out.append((_decode(values[:40]), _decode(values[40:])))
    return out


class Pages:
    """The rank pages of a checkpoint, read (and checked against the manifest) when first needed."""

    def __init__(self, directory: Spot | Path, records: Mapping[str, FileRecord], world: int) -> None:
        self.directory, self.records, self.world = spot_of(directory), records, world
        self.pages: dict[int, list[tuple[FileRecord, FileRecord]]] = {}
        self.lock = threading.Lock()

    def _read(self, page: int) -> list[tuple[FileRecord, FileRecord]]:
        name = page_name(page)
        where = f"{self.directory}/{name}"
        buffer, _ = (self.directory / name).read(self.records[name], where=where, limit=MAX_JSON)
        raw = parse_json(buffer.numpy().data, where)
        first = page * PAGE_RANKS
        count = min(PAGE_RANKS, self.world - first)
        return list(RankPage.decode(raw, first=first, count=count, where=where).ranks)

    def of(self, rank: int) -> tuple[FileRecord, FileRecord]:
        """Rank ``rank``'s ``(shard, rng)`` records."""
        page = rank // PAGE_RANKS
        with self.lock:
            if page not in self.pages:
                self.pages[page] = self._read(page)
            return self.pages[page][rank % PAGE_RANKS]


def _targets(state: TrainState, content: StateFile, where: str) -> dict[str, Any]:
    """The live tensor each saved key is meant for, where the target has one: ``{group: {key: tensor}}``."""
    strategy = strategy_of(state.model)
    model = strategy.target(state.model)
    found: dict[str, Any] = {
        "model": model,
        "optimizer": {},
        "ownership": strategy.ownership(state.model),
        "owns_param": strategy.owns_param,
    }
    if state.optimizer is None:
        return found
    saved = None if content.optimizer is None else content.optimizer.state_dict
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    try:
        groups = decode(groups, tensors={}, where=where)
    except CheckpointError:
        return found
    live_groups, _ = strategy.optimizer_view(state.optimizer)
    if not isinstance(groups, list) or len(groups) != len(live_groups):
        return found
    params: dict[int, Any] = {}
    for group, live in zip(groups, live_groups, strict=True):
        ids = group.get("params") if isinstance(group, dict) else None
        if isinstance(ids, list) and len(ids) == len(live["params"]):
            params.update({i: p for i, p in zip(ids, live["params"], strict=True) if type(i) is int})
    found["param_of"] = params
    found["state_of"] = {i: state.optimizer.state.get(p, {}) for i, p in params.items()}
    found["elementwise"] = elementwise_optimizer(state.optimizer)
    return found


def _target_for(targets: Mapping[str, Any], group: str, key: str, placed: Placed) -> Any:
    """What ``key`` loads into: the live tensor (for an optimizer state of the parameter's shape, the
    parameter), ``True`` for a whole plain tensor, None for nothing: a tensor that fits nothing the
    target can take (a model tensor of another shape; an optimizer state that fits neither its
    parameter nor the target's own state, nor, for a built-in optimizer, a scalar), never read, so
    that a forged shape costs no allocation; the checks name it."""
    if group == "model":
        live = targets["model"].get(key)
        return (
            live
            if live is not None and (tuple(live.shape), live.dtype) == (placed.shape, placed.dtype)
            else None
        )
    parts = key.split(".")
    number = int(parts[1]) if len(parts) == 3 and parts[0] == "state" and parts[1].isdigit() else None
    live = targets.get("param_of", {}).get(number)
    if live is not None and not targets["owns_param"](live):
        return None  # another pipeline stage's optimizer state: its rank reads it
    # Elementwise state (exp_avg) is sharded as its parameter; anything else (a 0-d step) is whole.
    if live is not None and (tuple(live.shape), live.dtype) == (placed.shape, placed.dtype):
        return live
    own = targets.get("state_of", {}).get(number, {}).get(parts[2]) if number is not None else None
    if isinstance(own, torch.Tensor):  # the target has stepped: its own state says what fits
        return True if (tuple(own.shape), own.dtype) == (placed.shape, placed.dtype) else None
    if targets.get("elementwise") and live is not None and math.prod(placed.shape) > 1:
        return None  # a built-in's state is its parameter's shape, or a scalar
    return True


def read_tensors(
    directory: Spot | Path,
    records: Mapping[str, FileRecord],
    world: int,
    state: TrainState,
    content: StateFile,
    *,
    where: str,
) -> tuple[dict[str, dict[str, torch.Tensor]], Pages]:
    """The tensors of a sharded checkpoint as ``{MODEL: {...}, OPTIMIZER: {...}}``, this rank's part only.

    A tensor meant for a DTensor whose part is one run of rows (FSDP2's
    ``Shard(0)``, a column-parallel layer's, with HSDP replicas or not:
    :func:`held_rows`) comes back as a DTensor of the same placement holding
    only this rank's rows; one meant for another DTensor (a row-parallel
    layer's ``Shard(1)``) is read whole and split locally; one for a plain
    tensor is read whole. A tensor with no matching target (absent, another
    shape or dtype) is a ``meta`` tensor of the saved shape: it is never read,
    and the checks report it.
    """
    directory = spot_of(directory)
    index = parse_index(content.tensors, world, where=f"{where}/state.json")
    targets = _targets(state, content, where)
    pages = Pages(directory, records, world)
    jobs: list[tuple[str, str, Placed, Any, int, int]] = []
    ownership = targets["ownership"]
    for group, entries in index.items():
        for key, placed in entries.items():
            if group == "model" and not ownership.owns(key):
                continue  # another rank's (a pipeline stage's): neither read nor checked here
            live = _target_for(targets, group, key, placed)
            # Only this rank's rows where its part is one run of them (FSDP2's Shard(0), a column-
            # parallel layer's, with HSDP replicas or not); else the whole tensor, split locally.
            start, stop = held_rows(live) or (0, rows_of(placed.shape))
            jobs.append((group, key, placed, live, start, stop))
    if any(group == "model" and live is None for group, _, _, live, _, _ in jobs):
        # A model tensor that does not fit: the checks will refuse the checkpoint, so nothing is
        # read (every tensor stays a meta tensor of its saved shape).
        jobs = [(group, key, placed, None, start, stop) for group, key, placed, _, start, stop in jobs]
    check_allocatable(jobs, where)
    needed = sorted(
        {c.rank for _, _, p, live, a, b in jobs if live is not None for c in overlaps(p, world, a, b)}
    )
    opened: dict[int, ShardFile] = {}
    try:
        step = content.step
        shard_files = in_parallel([_opener(directory, pages, rank, step) for rank in needed])
        opened = dict(zip(needed, shard_files, strict=True))
        local = threading.local()

        def run(job: tuple[str, str, Placed, Any, int, int]) -> Callable[[], torch.Tensor]:
            group, key, placed, live, start, stop = job

            def read() -> torch.Tensor:
                if live is None:
                    return torch.empty(placed.shape, dtype=placed.dtype, device="meta")
                found = overlaps(placed, world, start, stop)
                for chunk in found:  # sizes checked against the files before anything is allocated
                    opened[chunk.rank].info(f"{group}/{key}", placed, chunk)
                out = empty_rows(placed, start, stop)
                view = byte_view(out)
                width = len(view) // max(1, stop - start) if placed.shape else len(view)
                scratch = getattr(local, "scratch", None)
                if scratch is None:
                    scratch = local.scratch = {}
                for chunk in found:
                    part = view[(chunk.use_start - start) * width : (chunk.use_stop - start) * width]
                    opened[chunk.rank].read(f"{group}/{key}", placed, chunk, part, scratch)
                return _as_target(out, live, placed)

            return read

        values = _pooled([run(job) for job in jobs])
    finally:
        for shard in opened.values():
            shard.close()
    out: dict[str, dict[str, torch.Tensor]] = {MODEL: {}, OPTIMIZER: {}}
    files = {group: file for file, group in GROUPS.items()}
    for (group, key, *_), value in zip(jobs, values, strict=True):
        out[files[group]][key] = value
    return out, pages


def check_allocatable(jobs: list[tuple[str, str, Placed, Any, int, int]], where: str) -> None:
    """Refuse, before any allocation, reads that need more memory than this process can take.

    What a rank allocates is bounded by its targets' shapes (a forged shape
    that fits nothing is never read); this bounds what is left, tensors the
    target takes whole without a shape to compare with (the state of an
    optimizer that has not stepped), by the memory available to the process
    (``MemAvailable``, and the address-space limit where one is set).
    """
    wanted = [
        (math.prod(p.shape[1:]) * (b - a) * p.dtype.itemsize if p.shape else p.dtype.itemsize, f"{g}/{k}")
        for g, k, p, live, a, b in jobs
        if live is not None
    ]
    room = allocatable_bytes()
    total = sum(size for size, _ in wanted)
    if room is not None and total > room:
        size, name = max(wanted)
        msg = (
            f"{where}: reading this checkpoint would allocate {total} bytes on this rank (the largest, "
            f"{name}, {size} bytes), more than the {room} this process can allocate: a checkpoint "
            "of a larger run (restore it where it fits), or a forged one"
        )
        raise CheckpointError(msg)


def _opener(directory: Spot, pages: Pages, rank: int, step: Any) -> Callable[[], ShardFile]:
    def open_one() -> ShardFile:
        name = shard_name(rank)
        return ShardFile(directory / name, pages.of(rank)[0], where=f"{directory}/{name}", step=step)

    return open_one


def _pooled(tasks: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
    if len(tasks) < 2:
        return [task() for task in tasks]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=_READERS, thread_name_prefix="faccel-read") as pool:
        futures = [pool.submit(task) for task in tasks]
        return [future.result() for future in futures]


def _as_target(out: torch.Tensor, live: Any, placed: Placed) -> torch.Tensor:
    """The rows read, as the target holds them: a DTensor of its placement, or a plain tensor."""
    if not is_dtensor(live):
        return out
    from torch.distributed.tensor import DTensor, distribute_tensor

    stride = tuple(math.prod(placed.shape[i + 1 :]) for i in range(len(placed.shape)))
    out = out.to(live.to_local().device)
    if held_rows(live) is not None:
        return DTensor.from_local(
            out,
            live.device_mesh,
            live.placements,
            run_check=False,
            shape=torch.Size(placed.shape),
            stride=stride,
        )
    return distribute_tensor(out, live.device_mesh, live.placements, src_data_rank=None)
