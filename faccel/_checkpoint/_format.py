"""The checkpoint format's names: every file, folder pattern and version, in one place.

Layout (the format is specified in docs/checkpoints.md)::

    ROOT/step-000000001200/      one complete checkpoint, named by its step
        manifest.json            format, version, step, and every file's size and hash
        state.json               step, epoch, position, optimizer param groups, scheduler,
                                 scaler and extras (tagged JSON, see _tagged_json.py)
        model.safetensors        the unwrapped model's weights (tied weights once)
        optimizer.safetensors    the optimizer's state tensors
        extras.safetensors       tensors of the scheduler, scaler and extras
        rng-00000.json ...       each rank's Python, NumPy, torch (and CUDA) generators
    ROOT/best/                   a named checkpoint (``checkpoint(..., name=...)``): read only when named
    ROOT/.tmp-step-.../          a checkpoint being written (``.tmp-best``: a named one): never read
    ROOT/.trash-step-.../        a checkpoint being deleted: never read
    ROOT/.replaced-step-.../     a checkpoint being replaced (``replace=True``): read only
                                 while its ``step-...`` folder is absent

The names a store also knows (the manifest, the step folders, the hidden
prefixes) are ``faccel._storage._names``'s, re-exported here; nothing else in
faccel spells these names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from faccel._storage._durable import BLAKE3, SHA256, FileRecord
from faccel._storage._names import LEFTOVER, MANIFEST, REPLACED, STEP_FOLDER, checkpoint_name, replaced_name
from faccel.errors import CheckpointError

__all__ = [
    "CHECKPOINT_FILE",
    "EXTRAS",
    "FILE_HASH",
    "FORMAT",
    "LEFTOVER",
    "MANIFEST",
    "MAX_SHARDED_WORLD",
    "MODEL",
    "MODEL_METADATA",
    "NAMED",
    "OPTIMIZER",
    "PAGE_RANKS",
    "RANKS_FORMAT",
    "REPLACED",
    "RNG_FORMAT",
    "STATE",
    "STATE_FORMAT",
    "STEP_FOLDER",
    "VERSION",
    "VERSION_SHARDED",
    "WHOLE_VERSIONS",
    "checkpoint_name",
    "expected_files",
    "file_records",
    "manifest_version",
    "page_name",
    "replaced_name",
    "rng_name",
    "shard_name",
]

# The manifest's "format" and "version": what restore accepts.
FORMAT = "faccel.checkpoint"
# The whole-tensor format, written now: its files' records are BLAKE3 digests.
VERSION = 3
# The sharded format: every rank writes its own shard file; rank pages list them (docs/checkpoints.md).
VERSION_SHARDED = 2
# The whole-tensor format: version 1 (SHA-256 records, read only) and the current one.
WHOLE_VERSIONS = (1, VERSION)
# The hash each version's file records hold, named as in the manifest's entries.
FILE_HASH: Mapping[int, str] = {1: SHA256, VERSION_SHARDED: SHA256, VERSION: BLAKE3}
# The "format" of state.json and of each rank's generator file.
STATE_FORMAT = "faccel.checkpoint.state"
RNG_FORMAT = "faccel.checkpoint.rng"
# The "format" of a rank page (version 2), and how many ranks one page lists.
RANKS_FORMAT = "faccel.checkpoint.ranks"
PAGE_RANKS = 1024
# The most ranks a sharded checkpoint holds: the manifest lists at most 1,024 rank pages, so what a
# rank reads at start (the manifest, its own page) stays under a fixed bound at any world size.
MAX_SHARDED_WORLD = PAGE_RANKS * PAGE_RANKS

STATE = "state.json"
# Hugging Face's single-file name and metadata, so that load_model reads a checkpoint's weights.
MODEL = "model.safetensors"
MODEL_METADATA: Mapping[str, str] = {"format": "pt"}
OPTIMIZER = "optimizer.safetensors"
EXTRAS = "extras.safetensors"


# Every file a checkpoint's writers put in its folder (of either format): what the cleanup of a
# folder never committed may delete, and nothing else (an object it cannot prove a checkpoint's stays).
CHECKPOINT_FILE = re.compile(
    r"(state\.json|model\.safetensors|optimizer\.safetensors|extras\.safetensors"
    r"|rng-\d{5,}\.json|shard-\d{5,}\.safetensors|ranks-\d{5,}\.json)"
)
# A named checkpoint's folder (``checkpoint(..., name="best")``): one path component, never a step's.
NAMED = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def rng_name(rank: int) -> str:
    """The file holding rank ``rank``'s random generators.

    Example:
        >>> rng_name(3)
        'rng-00003.json'
    """
    return f"rng-{rank:05d}.json"


def shard_name(rank: int) -> str:
    """The file holding the tensor chunks rank ``rank`` wrote (version 2).

    Example:
        >>> shard_name(3)
        'shard-00003.safetensors'
    """
    return f"shard-{rank:05d}.safetensors"


def page_name(page: int) -> str:
    """The rank page listing ranks ``page * PAGE_RANKS`` on (version 2).

    Example:
        >>> page_name(0)
        'ranks-00000.json'
    """
    return f"ranks-{page:05d}.json"


def expected_files(world_size: int, version: int = VERSION) -> list[str]:
    """The files a checkpoint of ``world_size`` ranks lists in its manifest.

    Version 2 (sharded) lists one rank page per ``PAGE_RANKS`` ranks, which
    list the ranks' own files (``shard-RANK.safetensors``, ``rng-RANK.json``);
    the whole-tensor versions (1 and 3) list every file.

    Example:
        >>> expected_files(2)  # doctest: +NORMALIZE_WHITESPACE
        ['state.json', 'model.safetensors', 'optimizer.safetensors', 'extras.safetensors',
         'rng-00000.json', 'rng-00001.json']
        >>> expected_files(2000, version=2)
        ['state.json', 'extras.safetensors', 'ranks-00000.json', 'ranks-00001.json']
    """
    if version == VERSION_SHARDED:
        return [STATE, EXTRAS, *(page_name(page) for page in range(-(-world_size // PAGE_RANKS)))]
    return [STATE, MODEL, OPTIMIZER, EXTRAS, *(rng_name(rank) for rank in range(world_size))]


def manifest_version(manifest: Mapping[str, Any], *, where: str) -> int:
    """The format version a parsed manifest states, if this faccel reads it (a key of :data:`FILE_HASH`).

    Raises :class:`CheckpointError` naming ``where`` otherwise.

    Example:
        >>> manifest_version({"version": 3}, where="m")
        3
    """
    version = manifest.get("version")
    if version not in FILE_HASH or type(version) is not int:
        msg = (
            f"{where}: format version {version!r}, but this faccel reads versions "
            f"{', '.join(map(str, sorted(FILE_HASH)))}; restore it with the faccel that wrote it"
        )
        raise CheckpointError(msg)
    return version


def file_records(files: Any, version: int, *, where: str) -> dict[str, FileRecord]:
    """The records of a manifest's ``files`` entries: each a size and the digest ``version`` names.

    Raises :class:`CheckpointError` naming ``where`` if an entry lacks either.

    Example:
        >>> file_records({"state.json": {"size": 3, "blake3": "ab"}}, 3, where="m")["state.json"]
        FileRecord(size=3, digest='ab', algorithm='blake3')
    """
    algorithm = FILE_HASH[version]
    records = {}
    for name, entry in (files if isinstance(files, dict) else {}).items():
        if (
            not isinstance(entry, dict)
            or type(entry.get("size")) is not int
            or not isinstance(entry.get(algorithm), str)
        ):
            msg = (
                f"{where}: the entry of {name} needs an int size and a {algorithm} string (version {version})"
            )
            raise CheckpointError(msg)
        records[name] = FileRecord(size=entry["size"], digest=entry[algorithm], algorithm=algorithm)
    return records
