"""Every name faccel gives a file or folder of its own in a store, in one place.

The stores (``_local``, ``_objects``) and the checkpoint format (``_checkpoint._format``) import
these; nothing else spells them. A root's writer lock, the manifest that commits a folder, the
hidden prefixes of a folder being written (``.tmp-``), deleted (``.trash-``) or replaced
(``.replaced-``), and the folder of a checkpoint at a step.
"""

from __future__ import annotations

import re

__all__ = [
    "ASIDE",
    "LEASE_BREAK",
    "LEFTOVER",
    "LOCK",
    "MANIFEST",
    "REPLACED",
    "STEP_FOLDER",
    "TMP",
    "TRASH",
    "checkpoint_name",
    "replaced_name",
]

# The file a root's writer holds (an OS lock on a disk, a lease object on an object store).
LOCK = ".lock"
# On an object store, the object whose conditional creation wins the right to break a dead
# writer's lease (followed by that lease's digest and a generation): of two that saw one stale
# lease, one breaks it; a breaker that died is passed by the next generation.
LEASE_BREAK = ".lock-broken-"
# The manifest: written last, it commits a checkpoint folder.
MANIFEST = "manifest.json"
# Hidden prefixes: a file or folder being written, one being deleted, one set aside while replaced.
TMP, TRASH, ASIDE = ".tmp-", ".trash-", ".replaced-"

# A complete checkpoint's folder (when it holds a faccel manifest), and the step it names.
STEP_FOLDER = re.compile(r"step-(\d{12,})")
# Folders of interrupted writes and deletions, of numbered and named checkpoints alike.
LEFTOVER = re.compile(r"\.(tmp|trash)-(step-\d{12,}|[A-Za-z0-9][A-Za-z0-9_.-]{0,127})")
# A checkpoint moved aside while its replacement is renamed in; the folder it names, and its step
# (group 2; None for a named checkpoint, which restore(root) never takes as the latest).
REPLACED = re.compile(r"\.replaced-(step-(\d{12,})|[A-Za-z0-9][A-Za-z0-9_.-]{0,127})")


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint at ``step``: zero-padded, so names sort by step.

    Example:
        >>> checkpoint_name(1200)
        'step-000000001200'
    """
    return f"step-{step:012d}"


def replaced_name(folder: str) -> str:
    """The name a checkpoint folder has while ``checkpoint(..., replace=True)`` replaces it.

    Example:
        >>> replaced_name("step-000000001200")
        '.replaced-step-000000001200'
    """
    return f"{ASIDE}{folder}"
