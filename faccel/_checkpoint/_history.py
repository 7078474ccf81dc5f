"""Named checkpoints and older ones: restoring any committed checkpoint, and rolling a root back.

A root holds numbered checkpoints (``step-N``, the run's history: ``restore(root)``
takes the latest) and named ones (``best``, ``epoch_0``: written with
``checkpoint(..., name=...)``, read only when named). Restoring one checkpoint
of a root that holds later numbered ones leaves a choice the user makes, not
faccel: the resumed run checkpoints into another root (``restore(...,
into=new_root)``, which must hold nothing later), or the later ones are an
abandoned future (``restore(..., rollback="move")`` moves them into
``root/abandoned-after-step-N/``, ``"delete"`` deletes them). Without either,
restore refuses at once, before anything is loaded, rather than let the run
meet those steps hours in.
"""

from __future__ import annotations

import os
import re
from typing import Literal

from faccel._checkpoint._folders import counted, hold_lock, read_folder_manifest, remove_leftovers, scan
from faccel._checkpoint._format import (
    EXTRAS,
    MANIFEST,
    MODEL,
    NAMED,
    OPTIMIZER,
    STATE,
    STEP_FOLDER,
    checkpoint_name,
)
from faccel._storage._store import Spot
from faccel.errors import ArgumentValueError, CheckpointError

__all__ = ["Rollback", "check_checkpoint_name", "check_restore_choice", "refuse_later", "set_aside"]

# What restore(..., rollback=...) does with the checkpoints after the restored one.
Rollback = Literal["move", "delete"]
_ROLLBACKS = ("move", "delete")
# The folder of a root that the checkpoints abandoned by a rollback to step N are moved into.
_ABANDONED = "abandoned-after-{}"
# Names a named checkpoint cannot take: a step's with any number of digits (restore and rotation
# would parse it as a step), a rollback's folder, and the files a checkpoint holds.
_RESERVED = re.compile(r"(?i)step-\d+|abandoned-after-.*")
_FILES = frozenset({MANIFEST, STATE, MODEL, OPTIMIZER, EXTRAS})


def check_checkpoint_name(name: str, *, keep: int | None) -> None:
    """Raise :class:`ArgumentValueError` unless ``name`` can name a checkpoint folder of a root.

    Example:
        >>> check_checkpoint_name("epoch_0", keep=None)
        >>> check_checkpoint_name("step-000000000001", keep=None)
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: checkpoint name 'step-000000000001' ...
    """
    if not NAMED.fullmatch(name) or STEP_FOLDER.fullmatch(name):
        msg = (
            f"checkpoint name {name!r} is not one plain folder name: expected letters, digits, '_', '.' "
            "and '-' (at most 128, starting with a letter or digit), not a numbered checkpoint's "
            "step-NNNNNNNNNNNN; for example name='best' or name='epoch_0'"
        )
        raise ArgumentValueError(msg)
    if _RESERVED.fullmatch(name) or name in _FILES:
        msg = (
            f"checkpoint name {name!r} is a name faccel gives things in a root or a checkpoint (step-N, "
            f"abandoned-after-..., {', '.join(sorted(_FILES))}): a folder of that name would be read as "
            "one of them; choose another, for example name='best' or name='epoch_0'"
        )
        raise ArgumentValueError(msg)
    if keep is not None:
        msg = (
            f"checkpoint(..., name={name!r}, keep={keep}): keep rotates the numbered checkpoints and "
            "never a named one; pass keep on the numbered checkpoints' calls"
        )
        raise ArgumentValueError(msg)


def check_restore_choice(into: str | os.PathLike[str] | None, rollback: str | None) -> None:
    """Raise :class:`ArgumentValueError` for a ``rollback`` value restore does not know, or both options.

    Example:
        >>> check_restore_choice(None, "move")
        >>> check_restore_choice("new", "move")
        Traceback (most recent call last):
        ...
        faccel.errors.ArgumentValueError: restore(..., into=..., rollback='move'): ...
    """
    if rollback is not None and rollback not in _ROLLBACKS:
        msg = f"rollback must be one of {_ROLLBACKS} or None, got {rollback!r}"
        raise ArgumentValueError(msg)
    if rollback is not None and into is not None:
        msg = (
            f"restore(..., into=..., rollback={rollback!r}): a rollback continues in the checkpoint's own "
            "root, into= names another one; pass one of them"
        )
        raise ArgumentValueError(msg)


def _later(root: Spot, step: int) -> list[Spot]:
    """The complete and damaged numbered checkpoints of ``root`` after ``step`` (one listing)."""
    later = []
    for later_step, folder in scan(root).folders:
        if later_step <= step:
            break
        if counted(read_folder_manifest(folder)):
            later.append(folder)
    return later


def refuse_later(path: Spot, step: int, *, folder: bool, into: Spot | None, rollback: str | None) -> None:
    """Raise unless the run restored from ``path`` (step ``step``) meets no later checkpoint of its own root.

    ``folder``: whether ``path`` is one checkpoint folder (else a root, whose
    latest was taken). ``into`` (the root the run checkpoints into) must hold
    nothing after ``step``; without it, ``path``'s own root must not (unless
    ``rollback``, which sets those aside after the checkpoint is checked). A
    root given as ``path`` (restore takes its latest) has nothing later.
    """
    if rollback is not None and not folder:
        msg = (
            f"restore(..., rollback={rollback!r}) of {path}: a rollback names the checkpoint folder to go "
            "back to (root/step-NNNNNNNNNNNN or a named one), not the root, whose latest has nothing after it"
        )
        raise CheckpointError(msg)
    if rollback is not None:
        return
    if into is not None:
        blocked = into.store.blocking_file(into.key)
        if blocked is not None:
            msg = (
                f"restore(..., into={str(into)!r}): {blocked} is a file, so no checkpoint can be written "
                "there; into= names the root this run checkpoints into (a folder, new or empty)"
            )
            raise CheckpointError(msg)
        later = _later(into, step)
        if later:
            msg = (
                f"restore(..., into={str(into)!r}): that root already holds checkpoints after step "
                f"{step} ({_names(later)}); the resumed run would meet them. Pass a new or empty root, or "
                "restore from that root's latest"
            )
            raise CheckpointError(msg)
        return
    if not folder:
        return  # a root: restore takes its latest, so nothing later is there
    later = _later(path.parent, step)
    if later:
        msg = (
            f"{path}: restoring step {step}, but its root {path.parent} also holds later checkpoints "
            f"({_names(later)}). The resumed run would meet them at its first later checkpoint and stop "
            "there (checkpoints never overwrite unasked), or leave them as the root's latest for the next "
            "restore. Choose before training: restore(..., into=new_root) when this run checkpoints into "
            "another root (the older checkpoint is only read), or restore(..., rollback='move') to move "
            "the later ones into an abandoned-after-step-N folder of the root (rollback='delete' deletes "
            "them)"
        )
        raise CheckpointError(msg)


def _names(folders: list[Spot]) -> str:
    names = sorted(folder.name for folder in folders)
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def set_aside(path: Spot, step: int, how: Rollback) -> list[Spot]:
    """Move (or delete) the numbered checkpoints of ``path``'s root after ``step``; where they went.

    The writing rank's work, under the root's writer lock (a live writer is
    refused by name). On a disk each folder leaves the root's numbered ones by
    one rename (``Store.move``, ``Store.retire``), so a crash leaves each either
    a checkpoint of the root or set aside.
    """
    root = path.parent
    store = root.store
    with hold_lock(root):
        remove_leftovers(root)  # an interrupted replace settles first, so its step is seen
        later = _later(root, step)
        if not later:
            return []
        if how == "move":
            aside = root / _ABANDONED.format(checkpoint_name(step))
            number = 1
            while store.is_folder(aside.key):  # a second rollback to the same step keeps the first one's
                number += 1
                aside = root / f"{_ABANDONED.format(checkpoint_name(step))}-{number}"
            store.make_folder(aside.key)
            moved = [aside / folder.name for folder in later]
            for folder, target in zip(later, moved, strict=True):
                store.move(folder.key, target.key)
            store.sync_folder(root.key)
            return moved
        for folder in later:
            store.retire(folder.key, committed=True)
        store.sync_folder(root.key)
        return later
