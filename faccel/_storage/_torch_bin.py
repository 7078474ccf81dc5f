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

import torch

from faccel._storage._durable import open_regular
from faccel.errors import CheckpointError

__all__ = ["BIN_INDEX_NAME", "BIN_NAME", "load_bin"]

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
        msg = (
            f"{path}: holds something other than tensors, or is damaged; faccel reads .bin weights "
            f"with torch.load(weights_only=True) only, which refused it ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''}). Convert trusted files with "
            "save_pretrained(safe_serialization=True), or use model.safetensors"
        )
        raise CheckpointError(msg) from None
    if not isinstance(loaded, dict) or not all(
        isinstance(name, str) and isinstance(value, torch.Tensor) for name, value in loaded.items()
    ):
        kind = type(loaded).__name__
        msg = f"{path}: must hold a flat mapping of names to tensors (a state dict), got {kind}"
        raise CheckpointError(msg)
    return loaded
