"""The checkpoint format's names: every file, folder pattern and version, in one place.

Layout (the format is specified in docs/checkpoints.md)::

    ROOT/step-000000001200/      one complete checkpoint, named by its step
        manifest.json            format, version, step, and every file's size and sha256
        state.json               step, epoch, position, optimizer param groups, scheduler,
                                 scaler and extras (tagged JSON, see _tagged_json.py)
        model.safetensors        the unwrapped model's weights (tied weights once)
        optimizer.safetensors    the optimizer's state tensors
        extras.safetensors       tensors of the scheduler, scaler and extras
        rng-00000.json ...       each rank's Python, NumPy, torch (and CUDA) generators
    ROOT/.tmp-step-.../          a checkpoint being written: never read
    ROOT/.trash-step-.../        a checkpoint being deleted: never read
    ROOT/.replaced-step-.../     a checkpoint being replaced (``replace=True``): read only
                                 while its ``step-...`` folder is absent

Nothing else in faccel spells these names; the modules that write and read
a checkpoint import them from here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "EXTRAS",
    "FORMAT",
    "LEFTOVER",
    "MANIFEST",
    "MODEL",
    "MODEL_METADATA",
    "OPTIMIZER",
    "REPLACED",
    "RNG_FORMAT",
    "STATE",
    "STATE_FORMAT",
    "STEP_FOLDER",
    "VERSION",
    "checkpoint_name",
    "expected_files",
    "replaced_name",
    "rng_name",
    "temporary_name",
    "trash_name",
]

# The manifest's "format" and "version": what restore accepts.
FORMAT = "faccel.checkpoint"
VERSION = 1
# The "format" of state.json and of each rank's generator file.
STATE_FORMAT = "faccel.checkpoint.state"
RNG_FORMAT = "faccel.checkpoint.rng"

MANIFEST = "manifest.json"
STATE = "state.json"
# Hugging Face's single-file name and metadata, so that load_model reads a checkpoint's weights.
MODEL = "model.safetensors"
MODEL_METADATA: Mapping[str, str] = {"format": "pt"}
OPTIMIZER = "optimizer.safetensors"
EXTRAS = "extras.safetensors"

# A complete checkpoint's folder (when it holds a faccel manifest), and the step it names.
STEP_FOLDER = re.compile(r"step-(\d{12,})")
# Folders of interrupted writes and deletions.
LEFTOVER = re.compile(r"\.(tmp|trash)-step-\d{12,}")
# A checkpoint moved aside while its replacement is renamed in; the step folder it names.
REPLACED = re.compile(r"\.replaced-(step-(\d{12,}))")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint at ``step``: zero-padded, so names sort by step.

    Example:
        >>> checkpoint_name(1200)
        'step-000000001200'
    """
    return f"step-{step:012d}"


def temporary_name(step: int) -> str:
    """The folder the checkpoint at ``step`` is written into before its commit.

    Example:
        >>> temporary_name(1200)
        '.tmp-step-000000001200'
    """
    return f".tmp-{checkpoint_name(step)}"


def trash_name(folder: str) -> str:
    """The name a checkpoint folder is renamed to before it is deleted.

    Example:
        >>> trash_name("step-000000001200")
        '.trash-step-000000001200'
    """
    return f".trash-{folder}"


def replaced_name(folder: str) -> str:
    """The name a checkpoint folder has while ``checkpoint(..., replace=True)`` replaces it.

    Example:
        >>> replaced_name("step-000000001200")
        '.replaced-step-000000001200'
    """
    return f".replaced-{folder}"


def rng_name(rank: int) -> str:
    """The file holding rank ``rank``'s random generators.

    Example:
        >>> rng_name(3)
        'rng-00003.json'
    """
    return f"rng-{rank:05d}.json"


def expected_files(world_size: int) -> list[str]:
    """Every file a checkpoint of ``world_size`` ranks holds, besides the manifest.

    Example:
        >>> expected_files(2)  # doctest: +NORMALIZE_WHITESPACE
        ['state.json', 'model.safetensors', 'optimizer.safetensors', 'extras.safetensors',
         'rng-00000.json', 'rng-00001.json']
    """
    return [STATE, MODEL, OPTIMIZER, EXTRAS, *(rng_name(rank) for rank in range(world_size))]
