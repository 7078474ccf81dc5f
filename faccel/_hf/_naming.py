"""The Hugging Face layout's names: the single file, the index, the shards, and a shard's size.

``model.safetensors`` when the weights fit ``max_shard_size``; otherwise shards
``model-TAG-00001-of-0000N.safetensors`` (``TAG``: 8 hex digits, new for each save of faccel's;
other tools write them untagged) and an index ``model.safetensors.index.json``, every file with
the metadata ``{"format": "pt"}``. What ``transformers`` and ``huggingface_hub`` write and read.
Saving (``_save_model``), loading (``_load_model``) and ``consolidate`` take the names from here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from faccel._checkpoint._format import MODEL, MODEL_METADATA
from faccel._storage._names import TMP
from faccel.errors import ArgumentValueError

__all__ = [
    "INDEX_NAME",
    "METADATA",
    "SHARD_FILE",
    "TEMPORARY_FILE",
    "WEIGHTS_NAME",
    "parse_size",
    "shard_names",
    "split_shards",
]

# The single-file name and metadata are the checkpoint's model file's too (one definition, in _format).
WEIGHTS_NAME = MODEL
INDEX_NAME = "model.safetensors.index.json"
METADATA = MODEL_METADATA
# The shards a save writes (tagged) or another tool wrote (untagged): those no committed index names go.
SHARD_FILE = re.compile(r"model(-[0-9a-f]{8})?-\d{5}-of-\d{5}\.safetensors")
# Temporary files of save_model's writes (atomic_write's ".tmp-" siblings), left by a crash or a failure.
TEMPORARY_FILE = re.compile(
    re.escape(TMP) + r"(model.*\.safetensors(\.index\.json)?|config\.json|generation_config\.json)"
)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or text like ``"5GB"`` (10^9) or ``"500MiB"`` (2^20).

    Example:
        >>> parse_size("5GB"), parse_size("2KiB"), parse_size(100)
        (5000000000, 2048, 100)
    """
    if isinstance(size, int):
        value = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)\s*", size, flags=re.IGNORECASE)
        if match is None:
            msg = f"max_shard_size must be bytes (int) or text like '5GB' or '500MiB', got {size!r}"
            raise ArgumentValueError(msg)
        value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value < 1:
        msg = f"max_shard_size must be at least 1 byte, got {size!r}"
        raise ArgumentValueError(msg)
    return value


def split_shards(sizes: Mapping[str, int], max_shard_size: int) -> list[list[str]]:
    """Group tensor names, in order, into shards of at most ``max_shard_size`` bytes.

    Greedy, as ``huggingface_hub`` does it: a tensor that does not fit the
    current shard starts the next; a tensor larger than the limit gets a shard
    of its own.

    Example:
        >>> split_shards({"a": 6, "b": 6, "c": 2, "d": 1}, 8)
        [['a'], ['b', 'c'], ['d']]
    """
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, size in sizes.items():
        if current and used + size > max_shard_size:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    if current or not shards:
        shards.append(current)
    return shards


def shard_names(count: int, tag: str | None = None) -> list[str]:
    """File names of ``count`` shards, as Hugging Face names them, with ``tag`` when given.

    :func:`save_model` tags the shards of each sharded save (8 hex digits, new
    for each save) so that they never replace the shards the committed index
    names; any name listed in the index's ``weight_map`` is valid for
    ``transformers`` and ``huggingface_hub``.

    Example:
        >>> shard_names(1), shard_names(2)
        (['model.safetensors'], ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors'])
        >>> shard_names(2, tag="0a1b2c3d")[0]
        'model-0a1b2c3d-00001-of-00002.safetensors'
    """
    if count == 1:
        return [WEIGHTS_NAME]
    prefix = "model" if tag is None else f"model-{tag}"
    return [f"{prefix}-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
