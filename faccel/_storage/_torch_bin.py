"""Legacy ``pytorch_model.bin`` weights, read through PyTorch's restricted loader.

Many published models still ship ``pytorch_model.bin`` (or shards listed in
``pytorch_model.bin.index.json``): ``torch.save``'s pickle-based format. This is
the one place faccel reads such a file, and only for :func:`faccel.load_model`
(never ``restore``): ``torch.load(weights_only=True)`` refuses every object
that is not a tensor or a plain container before it is built, so a file that
would run code runs nothing. The files are memory-mapped where their format
allows, and what they hold must be a flat mapping of names to tensors.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from faccel._storage._durable import open_regular
from faccel._storage._store import Spot
from faccel.errors import CheckpointError

__all__ = ["BIN_INDEX_NAME", "BIN_NAME", "load_bin", "load_bin_bytes", "read_bin"]

BIN_NAME = "pytorch_model.bin"
BIN_INDEX_NAME = "pytorch_model.bin.index.json"


def load_bin(path: Path, within: Sequence[Path] = ()) -> dict[str, torch.Tensor]:
    """The tensors of one ``.bin`` file, read by the restricted loader (memory-mapped where it can).

    The file must be a regular file, and a symbolic link is followed only into
    the folders ``within`` (real paths; none: links are refused).

    Raises:
        CheckpointError: The file holds anything but a flat mapping of names
            to tensors (nothing in it is run), or is damaged or missing, not a
            regular file, or a link out of ``within``.

    Example:
        >>> import pathlib, tempfile, torch
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "pytorch_model.bin"
        >>> torch.save({"w": torch.ones(2)}, path)
        >>> load_bin(path)["w"].tolist()
        [1.0, 1.0]
    """
    if not os.path.lexists(path):
        msg = f"{path}: not found; pass the folder that holds every weights file"
        raise CheckpointError(msg)
    os.close(open_regular(path, where=str(path), within=within))  # a regular file, no link out
    real = Path(os.path.realpath(path)) if within else path
    try:
        try:
            loaded = torch.load(real, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error):
                raise
            # Files from torch < 1.6 (the legacy, non-zip format) cannot be memory-mapped.
            loaded = torch.load(real, map_location="cpu", weights_only=True)
    except Exception as error:  # the restricted unpickler's load_problem, or a damaged file
        raise _refused(str(path), error) from None
    return _checked(loaded, str(path))


def load_bin_bytes(data: bytes, *, where: str) -> dict[str, torch.Tensor]:
    """The tensors of a ``.bin`` file's bytes (an object read whole from object storage), read by the
    restricted loader and checked as :func:`load_bin` checks a file.

    Example:
        >>> import io, torch
        >>> out = io.BytesIO()
        >>> torch.save({"w": torch.ones(2)}, out)
        >>> load_bin_bytes(out.getvalue(), where="memory")["w"].tolist()
        [1.0, 1.0]
    """
    import io

    try:
        loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as error:  # the restricted unpickler's load_problem, or damaged bytes
        raise _refused(where, error) from None
    return _checked(loaded, where)


def _refused(path: str, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{path}: holds something other than tensors, or is damaged; faccel reads .bin weights "
        f"with torch.load(weights_only=True) only, which refused it ({type(error).__name__}: "
        f"{str(error).splitlines()[0] if str(error) else ''}). Convert trusted files with "
        "save_pretrained(safe_serialization=True), or use model.safetensors"
    )


def _checked(loaded: Any, path: str) -> dict[str, torch.Tensor]:
    """``loaded`` when it is a flat mapping of names to tensors whose views write no more than they hold."""
    if not isinstance(loaded, dict) or not all(
        isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in loaded.items()
    ):
        kind = type(loaded).__name__
        msg = f"{path}: must hold a flat mapping of names to tensors (a state dict), got {kind}"
        raise CheckpointError(msg)
    problem = overlap_problem(loaded)
    if problem:
        msg = f"{path}: {problem}; a torch.save of a state dict never holds such views, so it is not read"
        raise CheckpointError(msg)
    return loaded


def overlap_problem(tensors: dict[str, torch.Tensor]) -> str:
    """Why ``tensors`` would write more bytes than their storages hold, or ``""``.

    A pickled tensor is a view of a storage: a stride-0 view of one element
    (``torch.zeros(1).expand(2**29)``, 1,619 bytes on disk) would make a 2 GiB
    file of its copy, and two views of overlapping bytes are two copies. Only
    views of disjoint bytes, and the same view under two names (tied weights,
    written once), keep what is written bounded by what was read.

    Example:
        >>> import torch
        >>> overlap_problem({"w": torch.zeros(1).expand(4)})[:40]
        "tensor 'w' is a view whose elements over"
        >>> base = torch.zeros(6)
        >>> overlap_problem({"a": base[:3], "b": base[3:], "tied": base[:3]})
        ''
    """
    seen: dict[int, list[tuple[int, int, tuple[Any, ...], str]]] = {}
    for name, tensor in tensors.items():
        if not tensor.numel():
            continue
        size = tensor.element_size()
        if any(stride < 0 for stride in tensor.stride()):  # pragma: no cover - torch has no negative strides
            return f"tensor {name!r} has a negative stride"
        span = int(sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True)) + 1) * size
        if tensor.numel() * size > span:
            return (
                f"tensor {name!r} is a view whose elements overlap ({list(tensor.shape)}, strides "
                f"{list(tensor.stride())}): its {span} bytes would be written as {tensor.numel() * size}"
            )
        start = int(tensor.storage_offset()) * size
        view = (tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()))
        for other_start, other_end, other_view, other in seen.setdefault(_storage_key(tensor), []):
            if (
                (other_start, other_view) != (start, view)
                and start < other_end
                and other_start < start + span
            ):
                return f"tensors {other!r} and {name!r} are views of overlapping bytes of one storage"
        seen[_storage_key(tensor)].append((start, start + span, view, name))
    return ""


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def read_bin(file: Spot, within: Sequence[Path] = ()) -> dict[str, torch.Tensor]:
    """The tensors of the ``.bin`` file at ``file`` on any store: memory-mapped from a disk
    (:func:`load_bin`), read whole from object storage (:func:`load_bin_bytes`).

    Example:
        >>> import tempfile, torch
        >>> from faccel._storage._roots import spot_of
        >>> folder = spot_of(tempfile.mkdtemp())
        >>> torch.save({"w": torch.ones(2)}, (folder / "pytorch_model.bin").key)
        >>> read_bin(folder / "pytorch_model.bin")["w"].tolist()
        [1.0, 1.0]
    """
    if file.store.local:
        return load_bin(Path(file.key), within)
    buffer, _ = file.read(None, where=str(file))
    return load_bin_bytes(buffer.numpy().tobytes(), where=str(file))
