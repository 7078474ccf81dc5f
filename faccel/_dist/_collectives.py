"""Collectives over pytrees: gather, reduce, broadcast and pad nested tensors across ranks.

A *tree* is a tensor, or a tuple, list, named tuple or mapping of trees.
Every collective here first exchanges a small description of each rank's tree
(the call, the tree's structure, each leaf's shape and dtype) as JSON bytes in
one fixed-size ``all_gather``. Every rank then checks the same descriptions, so
a mismatch (another structure, dtype or shape, or another collective called on
another rank) raises the same :class:`~faccel.errors.DistributedError` on every
rank, naming the rank and the leaf, instead of hanging or returning garbage.
The data itself then moves in one collective per call (per dtype for
``reduce``): leaves are packed into one flat buffer, as one bucket is far
faster than one collective per tensor.

In one process (world size 1, not simulated) the collectives communicate
nothing. A simulated :class:`~faccel.DistState` with more than one rank has no
peers to talk to, and every collective refuses it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as tdist

from faccel._choices import ReduceOpName
from faccel._dist._mesh import data_group
from faccel._dist._process_group import comm_device, peers_answer, require_peers
from faccel._dist._state import DistState
from faccel._tree import flatten_with_paths, rebuild
from faccel.errors import ArgumentError, ArgumentValueError, DistributedError

__all__ = [
    "all_gather_bytes",
    "any_rank",
    "broadcast",
    "gather",
    "gather_object",
    "gather_sizes",
    "pad_across_processes",
    "reduce",
]

# op name -> torch.distributed op; "mean" is a sum divided by the world size.
_OPS: Mapping[str, Any] = {
    "sum": tdist.ReduceOp.SUM,
    "mean": tdist.ReduceOp.SUM,
    "max": tdist.ReduceOp.MAX,
    "min": tdist.ReduceOp.MIN,
}
# Leaves are packed at offsets that are multiples of this, so a byte slice can be
# viewed as any dtype (complex128 has the largest element, 16 bytes).
_ALIGN = 16
# Bytes of the description buffer exchanged first; a larger description takes a second round.
_META_BYTES = 1024


# --- descriptions exchanged before the data ------------------------------------------------------


def _describe(call: str, tree: Any) -> tuple[dict[str, Any], list[Any], list[str]]:
    leaves, paths, spec = flatten_with_paths(tree)
    shapes = [list(leaf.shape) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    dtypes = [str(leaf.dtype) if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
    return {"call": call, "spec": spec, "shapes": shapes, "dtypes": dtypes}, leaves, paths


def all_gather_bytes(payload: bytes, size: int, device: torch.device, world: int) -> list[bytes]:
    """Every rank's buffer: a 4-byte length, then its payload if it fits in ``size - 4`` bytes.

    A payload that does not fit is sent as its length only, so that every rank
    learns the longest length and can repeat the exchange with a buffer that fits.
    """
    buffer = torch.zeros(size, dtype=torch.uint8)
    buffer[:4] = torch.tensor(list(len(payload).to_bytes(4, "little")), dtype=torch.uint8)
    fits = len(payload) <= size - 4
    if fits:
        buffer[4 : 4 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    out = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(world)]
    tdist.all_gather(out, buffer.to(device))
    return [bytes(t.cpu().numpy().tobytes()) for t in out]


def _exchange(dist: DistState, description: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's description, in rank order: one small all_gather (two for big trees).

    JSON in a byte tensor, not ``all_gather_object``: no pickle, and one
    collective instead of two when the description fits in ``_META_BYTES``.
    """
    payload = json.dumps(description, separators=(",", ":")).encode()
    device = comm_device(dist)
    name = description["call"].split("(")[0]
    with peers_answer(dist, name):
        raw = all_gather_bytes(payload, _META_BYTES, device, dist.world_size)
        lengths = [int.from_bytes(r[:4], "little") for r in raw]
        if max(lengths) > _META_BYTES - 4:
            raw = all_gather_bytes(payload, max(lengths) + 4, device, dist.world_size)
    return [json.loads(r[4 : 4 + n]) for r, n in zip(raw, lengths, strict=True)]


def _check_calls(descriptions: list[dict[str, Any]], paths: list[str]) -> None:
    """Raise (identically on every rank) unless all ranks made the same call on the same structure."""
    ref = descriptions[0]
    for rank, d in enumerate(descriptions):
        if d["call"] != ref["call"]:
            msg = (
                f"rank {rank} called {d['call']} while rank 0 called {ref['call']}; every rank "
                "must call the same collective, with the same options, in the same order"
            )
            raise DistributedError(msg)
        if d["spec"] != ref["spec"]:
            msg = (
                f"rank {rank} passed a tree of structure {d['spec']} but rank 0 passed "
                f"{ref['spec']}; every rank must pass the same containers and keys"
            )
            raise DistributedError(msg)
    for path, shape in zip(paths, ref["shapes"], strict=True):
        if shape is None:
            msg = (
                f"every leaf of a collective's tree must be a torch.Tensor, but {path} is not "
                f"(structure {ref['spec']}); convert numbers with torch.tensor(...) or use gather_object"
            )
            raise ArgumentError(msg)


def _check_leaves(
    descriptions: list[dict[str, Any]],
    paths: list[str],
    *,
    what: str,
    same: Callable[[list[int], list[int]], bool],
    dtypes: bool = True,
) -> None:
    """Raise (identically on every rank) where a leaf's dtype or shape differs from rank 0's."""
    ref = descriptions[0]
    for rank, d in enumerate(descriptions):
        for i, path in enumerate(paths):
            if dtypes and d["dtypes"][i] != ref["dtypes"][i]:
                msg = (
                    f"{path} is {d['dtypes'][i]} on rank {rank} but {ref['dtypes'][i]} on rank 0; "
                    "cast it to one dtype on every rank before the collective"
                )
                raise DistributedError(msg)
            if not same(d["shapes"][i], ref["shapes"][i]):
                msg = (
                    f"{path} has shape {tuple(d['shapes'][i])} on rank {rank} but "
                    f"{tuple(ref['shapes'][i])} on rank 0; {what}"
                )
                raise DistributedError(msg)


def _check_local(tree: Any, name: str) -> tuple[list[Any], list[str]]:
    """World size 1: the same leaf-type check the exchange makes, without communicating."""
    leaves, paths, spec = flatten_with_paths(tree)
    for leaf, path in zip(leaves, paths, strict=True):
        if not isinstance(leaf, torch.Tensor):
            msg = (
                f"every leaf of {name}()'s tree must be a torch.Tensor, but {path} is "
                f"{type(leaf).__qualname__} (structure {spec}); convert numbers with torch.tensor(...) "
                "or use gather_object"
            )
            raise ArgumentError(msg)
    return leaves, paths


# --- packing leaves into one byte buffer ---------------------------------------------------------


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    count = 1
    for n in shape:
        count *= n
    return count * dtype.itemsize


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _layout(shapes: Sequence[Sequence[int]], dtypes: Sequence[torch.dtype]) -> tuple[list[int], int]:
    """Byte offsets of each leaf in a packed buffer, and the buffer's length."""
    offsets, end = [], 0
    for shape, dtype in zip(shapes, dtypes, strict=True):
        offsets.append(end)
        end = _aligned(end + _nbytes(shape, dtype))
    return offsets, end


def _pack(leaves: Sequence[torch.Tensor], length: int, device: torch.device) -> torch.Tensor:
    parts, end = [], 0
    for leaf in leaves:
        data = leaf.detach().contiguous().reshape(-1).view(torch.uint8).to(device)
        parts.append(data)
        end += data.numel()
        gap = _aligned(end) - end
        if gap:
            parts.append(torch.zeros(gap, dtype=torch.uint8, device=device))
            end += gap
    if length > end:
        parts.append(torch.zeros(length - end, dtype=torch.uint8, device=device))
    if not parts:
        return torch.zeros(length, dtype=torch.uint8, device=device)
    return torch.cat(parts)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        msg = f"a peer described a tensor of dtype {name!r}, which this torch does not know"
        raise DistributedError(msg)
    return dtype


# --- the collectives -----------------------------------------------------------------------------


def _as_rows(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.reshape(1) if leaf.ndim == 0 else leaf


def gather_sizes(dist: DistState, tree: Any, *, call: str = "gather") -> tuple[Any, list[list[int]]]:
    """Like :func:`gather`, also returning each rank's dim-0 size of each leaf.

    ``sizes[rank][leaf]`` follows the leaf order of a depth-first walk of the
    tree. :func:`faccel.gather_for_metrics` uses the sizes to place rows.

    Example:
        >>> import torch, faccel
        >>> gathered, sizes = gather_sizes(faccel.detect({}), {"x": torch.ones(3, 2)})
        >>> gathered["x"].shape, sizes
        (torch.Size([3, 2]), [[3]])
    """
    require_peers(dist, "gather")
    if not dist.distributed:
        leaves, _ = _check_local(tree, "gather")
        rows = [_as_rows(leaf) for leaf in leaves]
        return rebuild(tree, rows), [[row.shape[0] for row in rows]]
    description, leaves, paths = _describe(call, tree)
    description["shapes"] = [[1] if s == [] else s for s in description["shapes"]]
    descriptions = _exchange(dist, description)
    _check_calls(descriptions, paths)
    _check_leaves(
        descriptions,
        paths,
        what="gather concatenates along dim 0, so every other dim must match (pad them first "
        "with faccel.pad_across_processes)",
        same=lambda a, b: a[1:] == b[1:] and len(a) == len(b),
    )
    dtypes = [_dtype(name) for name in descriptions[0]["dtypes"]]
    layouts = [_layout(d["shapes"], dtypes) for d in descriptions]
    longest = max(length for _, length in layouts)
    device = comm_device(dist)
    rows = [_as_rows(leaf) for leaf in leaves]
    buffer = _pack(rows, longest, device)
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(dist.world_size)]
    if longest:
        with peers_answer(dist, call.split("(")[0]):
            tdist.all_gather(received, buffer)
    gathered = []
    for i, (leaf, dtype) in enumerate(zip(rows, dtypes, strict=True)):
        pieces = []
        for rank, d in enumerate(descriptions):
            start = layouts[rank][0][i]
            pieces.append(received[rank][start : start + _nbytes(d["shapes"][i], dtype)])
        total = sum(d["shapes"][i][0] for d in descriptions)
        joined = torch.cat(pieces).view(dtype).reshape(total, *leaf.shape[1:])
        gathered.append(joined.to(leaf.device))
    sizes = [[d["shapes"][i][0] for i in range(len(rows))] for d in descriptions]
    return rebuild(tree, gathered), sizes


def gather(dist: DistState, tree: Any) -> Any:
    """Concatenate every rank's tensors along dim 0, in rank order, on every rank.

    Dim-0 sizes may differ between ranks (each rank's rows are kept whole, no
    padding is added to the result); all other dims and the dtype must match.
    A 0-d tensor counts as one row, so a scalar loss gathers to shape
    ``(world_size,)`` (and to ``(1,)`` in one process). Results stay on each
    leaf's device. Rows are grouped by rank, so over a prepared loader (whose
    ranks read alternate samples of each global batch) the samples come back
    interleaved, rank 0's then rank 1's, as from Accelerate's ``gather``. For
    evaluation over a prepared loader, use :func:`faccel.gather_for_metrics`,
    which keeps the epoch's order and drops the loader's padding.

    Args:
        dist: This process's state.
        tree: A tensor, or nested tuples, lists, named tuples and dicts of tensors.
            Every rank passes the same structure.

    Returns:
        A tree of the same structure with the concatenated tensors. In one
        process no data moves: the tree's own tensors come back (0-d ones reshaped).

    Raises:
        DistributedError: ``dist`` is simulated with several ranks, no process group
            runs, the ranks' trees differ in structure, dtype or shape beyond dim 0
            (the message names the rank and the leaf), or a peer crashed or did not
            answer within ``dist.timeout``.
        ArgumentError: A leaf is not a tensor.

    Example:
        >>> import torch, faccel
        >>> out = gather(faccel.detect({}), {"logits": torch.ones(2, 3), "loss": torch.tensor(0.5)})
        >>> out["logits"].shape, out["loss"]
        (torch.Size([2, 3]), tensor([0.5000]))
    """
    return gather_sizes(dist, tree)[0]


def reduce(dist: DistState, tree: Any, op: ReduceOpName = "mean") -> Any:
    """Combine every rank's tensors elementwise: ``'sum'``, ``'mean'``, ``'max'`` or ``'min'``.

    The inputs are not modified; new tensors come back, the same on every
    rank. Shapes and dtypes must match across ranks. ``'mean'`` sums then
    divides by the number of ranks combined, so it needs floating-point (or
    complex) leaves. Under a layout with tensor parallelism the ranks of one
    tensor-parallel group hold the same batch (and loss): each leaf is
    combined over the data-parallel ranks only (``dist.data_world_size`` of
    them), so a ``'sum'`` counts each batch once.

    Args:
        dist: This process's state.
        tree: A tensor or nested containers of tensors, the same structure on every rank.
        op: ``'sum'``, ``'mean'``, ``'max'`` or ``'min'``.

    Returns:
        A tree of the same structure. In one process, the tree itself.

    Raises:
        ArgumentValueError: Unknown ``op``.
        ArgumentError: ``'mean'`` of an integer or bool tensor, or a leaf that is not a tensor.
        DistributedError: As :func:`gather`, or the ranks' shapes differ.

    Example:
        >>> import torch, faccel
        >>> reduce(faccel.detect({}), {"loss": torch.tensor(2.0)}, op="sum")
        {'loss': tensor(2.)}
    """
    return _reduce(dist, tree, op, data_only=True)


def _reduce(dist: DistState, tree: Any, op: str, *, data_only: bool) -> Any:
    require_peers(dist, "reduce")
    if not dist.distributed:
        leaves, paths = _check_local(tree, "reduce")
        _check_op(op, leaves, paths)
        return tree
    description, leaves, paths = _describe(f"reduce(op={op!r})", tree)
    descriptions = _exchange(dist, description)
    _check_calls(descriptions, paths)
    _check_leaves(
        descriptions,
        paths,
        what="reduce combines elementwise, so shapes must match on every rank",
        same=lambda a, b: a == b,
    )
    _check_op(op, leaves, paths)
    device = comm_device(dist)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, leaf in enumerate(leaves):
        by_dtype.setdefault(leaf.dtype, []).append(i)
    reduced: list[Any] = [None] * len(leaves)
    group, count = (data_group(dist), dist.data_world_size) if data_only else (None, dist.world_size)
    for indices in by_dtype.values():
        flat = torch.cat([leaves[i].detach().reshape(-1).to(device) for i in indices])
        with peers_answer(dist, "reduce"):
            tdist.all_reduce(flat, op=_OPS[op], group=group)
        if op == "mean":
            flat /= count
        for i, piece in zip(indices, flat.split([leaves[i].numel() for i in indices]), strict=True):
            reduced[i] = piece.view(leaves[i].shape).to(leaves[i].device)
    return rebuild(tree, reduced)


def any_rank(dist: DistState, flag: bool | torch.Tensor) -> bool:
    """Whether ``flag`` is true on any rank, answered alike on every rank (a collective).

    Accelerate's ``set_trigger`` / ``check_trigger`` as one value: a rank that
    sees a NaN loss (or a time limit, or a signal) says so, and every rank
    learns it at the same step, so all leave the loop together instead of
    some waiting in the next collective. Every rank must call it.

    Args:
        dist: The run's :class:`DistState`.
        flag: This rank's condition: a bool, or a one-element tensor.

    Returns:
        True when any rank's ``flag`` is true.

    Raises:
        DistributedError: As :func:`reduce`.

    Example:
        >>> import torch, faccel
        >>> loss = torch.tensor(float("nan"))
        >>> faccel.any_rank(faccel.detect({}), torch.isnan(loss))
        True
    """
    value = torch.tensor([1.0 if bool(flag) else 0.0], device=dist.device)
    # Over every rank, tensor-parallel peers included: a flag need not be the same on them.
    return bool(_reduce(dist, value, "max", data_only=False).item() > 0)


def _check_op(op: str, leaves: list[torch.Tensor], paths: list[str]) -> None:
    if op not in _OPS:
        msg = f"op must be one of {sorted(_OPS)}, got {op!r}"
        raise ArgumentValueError(msg)
    if op == "mean":
        for leaf, path in zip(leaves, paths, strict=True):
            if not (leaf.is_floating_point() or leaf.is_complex()):
                msg = (
                    f"op='mean' divides by the world size, but {path} is {leaf.dtype}; "
                    "cast it to a floating dtype first, or use op='sum'"
                )
                raise ArgumentError(msg)


def broadcast(dist: DistState, tree: Any, *, src: int = 0) -> Any:
    """Every rank gets rank ``src``'s tensors.

    The other ranks pass a tree of the same structure; its leaves only say
    where the results go (their device): shapes and dtypes come from ``src``,
    so a rank need not know in advance how long ``src``'s tensors are.

    Args:
        dist: This process's state.
        tree: A tensor or nested containers of tensors, the same structure on every rank.
        src: The rank whose values everyone receives.

    Returns:
        On ``src``, ``tree`` itself; elsewhere a new tree with ``src``'s values.

    Raises:
        ArgumentValueError: ``src`` is not a rank.
        ArgumentError: A leaf is not a tensor.
        DistributedError: As :func:`gather`, or the ranks' structures or ``src`` differ.

    Example:
        >>> import torch, faccel
        >>> broadcast(faccel.detect({}), [torch.arange(3)], src=0)
        [tensor([0, 1, 2])]
    """
    require_peers(dist, "broadcast")
    if not dist.distributed:
        _check_src(src, dist.world_size)
        _check_local(tree, "broadcast")
        return tree
    description, leaves, paths = _describe(f"broadcast(src={src})", tree)
    descriptions = _exchange(dist, description)
    _check_calls(descriptions, paths)  # checked after the exchange, so every rank raises alike
    _check_src(src, dist.world_size)
    source = descriptions[src]
    shapes = source["shapes"]
    dtypes = [_dtype(name) for name in source["dtypes"]]
    offsets, length = _layout(shapes, dtypes)
    device = comm_device(dist)
    if dist.rank == src:
        buffer = _pack(leaves, length, device)
    else:
        buffer = torch.empty(length, dtype=torch.uint8, device=device)
    if length:
        with peers_answer(dist, "broadcast"):
            tdist.broadcast(buffer, src=src)
    if dist.rank == src:
        return tree
    received = [
        buffer[start : start + _nbytes(shape, dtype)].view(dtype).reshape(shape).to(leaf.device)
        for leaf, start, shape, dtype in zip(leaves, offsets, shapes, dtypes, strict=True)
    ]
    return rebuild(tree, received)


def _check_src(src: int, world_size: int) -> None:
    if not 0 <= src < world_size:
        msg = f"src must be a rank in [0, {world_size}), got {src!r}"
        raise ArgumentValueError(msg)


def pad_across_processes(
    dist: DistState, tree: Any, *, dim: int = 0, pad_index: int | float = 0, pad_first: bool = False
) -> Any:
    """Pad every tensor along ``dim`` to the largest size any rank has there.

    The usual step before :func:`gather` when, say, generated sequences have
    different lengths on different ranks. Leaves with too few dimensions to
    have ``dim`` (a scalar loss beside padded logits) come back unchanged.

    Args:
        dist: This process's state.
        tree: A tensor or nested containers of tensors, the same structure on every rank.
        dim: The dimension to pad (negative counts from the end).
        pad_index: The value to pad with.
        pad_first: Pad at the start (left padding) instead of the end.

    Returns:
        A tree of the same structure; unpadded leaves are the input tensors themselves.

    Raises:
        DistributedError: As :func:`gather`, or a leaf has different numbers of
            dimensions on different ranks.
        ArgumentError: A leaf is not a tensor.

    Example:
        >>> import torch, faccel
        >>> pad_across_processes(faccel.detect({}), torch.ones(2, 3), dim=1).shape
        torch.Size([2, 3])
    """
    require_peers(dist, "pad_across_processes")
    if not dist.distributed:
        _check_local(tree, "pad_across_processes")
        return tree
    description, leaves, paths = _describe(f"pad_across_processes(dim={dim})", tree)
    descriptions = _exchange(dist, description)
    _check_calls(descriptions, paths)
    _check_leaves(
        descriptions,
        paths,
        what="pad_across_processes needs the same number of dimensions on every rank",
        same=lambda a, b: len(a) == len(b),
        dtypes=False,
    )
    padded = []
    for i, leaf in enumerate(leaves):
        if not -leaf.ndim <= dim < leaf.ndim:
            padded.append(leaf)
            continue
        axis = dim % leaf.ndim
        longest = max(d["shapes"][i][axis] for d in descriptions)
        if longest == leaf.shape[axis]:
            padded.append(leaf)
            continue
        shape = list(leaf.shape)
        shape[axis] = longest
        out = leaf.new_full(shape, pad_index)
        start = longest - leaf.shape[axis] if pad_first else 0
        out.narrow(axis, start, leaf.shape[axis]).copy_(leaf)
        padded.append(out)
    return rebuild(tree, padded)


def gather_object(dist: DistState, obj: Any) -> list[Any]:
    """Every rank's Python object, in rank order. **Uses pickle** — read this first.

    This is :func:`torch.distributed.all_gather_object`, which **pickles**
    ``obj`` on each rank and unpickles the others' objects in memory. That is
    safe only because the bytes come from this job's own ranks over the
    process group, never from a file or the network at large; it is the one
    place faccel lets pickle run. Unpickling can execute code: never use it to
    exchange data that came from outside the job. For tensors use
    :func:`gather`, which is pickle-free and much faster.

    Args:
        dist: This process's state.
        obj: Any picklable object (strings, numbers, lists, dicts of them...).

    Returns:
        ``[obj_of_rank_0, obj_of_rank_1, ...]``; ``[obj]`` in one process.

    Raises:
        DistributedError: ``dist`` is simulated with several ranks, or no process group runs.

    Example:
        >>> import faccel
        >>> gather_object(faccel.detect({}), {"path": "ckpt/", "ok": True})
        [{'path': 'ckpt/', 'ok': True}]
    """
    require_peers(dist, "gather_object")
    if not dist.distributed:
        return [obj]
    out: list[Any] = [None] * dist.world_size
    with peers_answer(dist, "gather_object"):
        tdist.all_gather_object(out, obj)
    return out
