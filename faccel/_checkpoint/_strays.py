"""Names in a committed checkpoint's folder that its manifest does not account for: damage, as a missing file.

A committed checkpoint holds exactly its manifest and the files it lists (and,
in the sharded format, each writing rank's ``shard-RANK.safetensors`` and
``rng-RANK.json``, which its rank pages list). Anything else under the folder
(an object copied in by hand, a file of another checkpoint, a subfolder) is
refused by name. Restore asks on one rank, by one listing of the chosen
folder: on object storage one LIST request per 1,000 objects, whatever the
world size. Writes in progress never trip it: they are under prefixes without
a manifest (on a disk their hidden ``.tmp-`` staging folder, on object storage
a prefix not yet committed), which restore does not open.
"""

from __future__ import annotations

import re

from faccel._checkpoint._format import MANIFEST, VERSION_SHARDED
from faccel._checkpoint._manifest import Manifest
from faccel._storage._store import Spot

__all__ = ["stray_names"]

_SHOWN = 5
_RANK_FILE = re.compile(r"(?:shard-(\d+)\.safetensors|rng-(\d+)\.json)")


def stray_names(folder: Spot, manifest: Manifest | None) -> str | None:
    """Why ``folder`` holds names its decoded ``manifest`` does not account for, or None.

    A manifest that does not decode (None) is not judged here: its decoding says what is
    wrong with it.
    """
    if manifest is None:
        return None
    files, world = manifest.files, manifest.world_size
    sharded = manifest.version == VERSION_SHARDED
    extra = []
    for entry in folder.entries():
        name = entry.name
        if name != MANIFEST and name not in files and not (sharded and _ranks(name, world)):
            extra.append(name + "/" if entry.folder else name)
        # (A listed name that is a folder, a link or a FIFO: the read of that file says so by name.)
    if not extra:
        return None
    extra.sort()
    shown = ", ".join(extra[:_SHOWN]) + (f" and {len(extra) - _SHOWN} more" if len(extra) > _SHOWN else "")
    return (
        f"{folder}: holds {shown}, which its {MANIFEST} does not list (an extra or stray object: a "
        "checkpoint holds its manifest's files only); remove it, or restore another checkpoint"
    )


def _ranks(name: str, world: int) -> bool:
    """Whether ``name`` is a writing rank's own file of the sharded format."""
    match = _RANK_FILE.fullmatch(name)
    return match is not None and int(match.group(1) or match.group(2)) < world
