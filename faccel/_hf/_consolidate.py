"""``python -m faccel consolidate CKPT OUT``: a checkpoint's weights in the Hugging Face layout, offline.

Reads a checkpoint's model tensors one at a time, without a process group
and whatever world size wrote it, and writes them as :func:`faccel.save_model`
does: ``model.safetensors``, or shards and ``model.safetensors.index.json``
above ``max_shard_size`` (metadata ``{"format": "pt"}``, tied weights once).
Each file's header is computed from the checkpoint's index before any tensor
is read, then each tensor is read whole (from every shard file that holds a
chunk of it, each hash block checked), written, and dropped: peak memory is
about the largest tensor. The sharded format (version 2) is read in chunks;
a whole-tensor checkpoint's ``model.safetensors`` is opened once, hashed in a
streaming pass, then read a tensor at a time from that same open file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from faccel._checkpoint._folders import latest_checkpoint
from faccel._checkpoint._format import MANIFEST, MODEL_METADATA
from faccel._checkpoint._weights_reader import byte_view, open_weights
from faccel._hf._naming import INDEX_NAME, parse_size, shard_names, split_shards
from faccel._storage._names import TMP
from faccel._storage._roots import shown, spot_of
from faccel._storage._safetensors import header_bytes
from faccel._storage._store import Spot
from faccel.errors import CheckpointError, StorageError

__all__ = ["consolidate"]


def _header(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], names: list[str]
) -> tuple[bytes, list[str]]:
    """A safetensors header for ``names`` (largest element size first, as faccel writes) and the order."""
    order = sorted(names, key=lambda name: -specs[name][0].itemsize)
    return header_bytes(specs, order, MODEL_METADATA), order


def _write_file(path: Spot, header: bytes, order: list[str], read: Callable[[str], torch.Tensor]) -> None:
    with path.store.publisher(path.key) as out:  # .tmp-NAME, then renamed: whole or absent
        out.write(header)
        for name in order:
            tensor = read(name)  # one tensor in memory at a time
            out.write(byte_view(tensor))
            del tensor
        out.close()


def consolidate(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    allow_sparse: bool = False,
) -> Path | str:
    """Write a checkpoint's model weights to ``out`` in the Hugging Face layout, one tensor at a time.

    ``python -m faccel consolidate CKPT OUT``. ``checkpoint`` is a checkpoint
    folder, or a root of them (its latest). No process group is needed, and
    any world size may have written it. Peak memory is about the largest
    tensor. The output is what :func:`faccel.save_model` writes for the model.

    Args:
        checkpoint: A checkpoint folder or a root folder of checkpoints.
        out: A new (or empty of weights) folder to write into: a path, or a URL of object
            storage (``s3://bucket/model``, docs/object-storage.md).
        max_shard_size: Largest output file, in bytes or as text (``"5GB"``).
        allow_sparse: Write the weights even when they claim more than twice the
            bytes the checkpoint's files occupy on disk (plus 64 MiB): files with
            holes, as a forged checkpoint has, or a file system that compresses.

    Returns:
        ``out``: a :class:`~pathlib.Path`, or the URL.

    Raises:
        CheckpointError: No checkpoint there, or a file that fails its checks;
            weights that claim more than the files occupy (see ``allow_sparse``),
            before anything is written.
        StorageError: ``out`` is a file, or already holds weights.
        ArgumentValueError: ``checkpoint`` or ``out`` is not a valid root (a mistyped URL).

    Example:
        >>> import tempfile, torch, faccel
        >>> root, model = tempfile.mkdtemp(), torch.nn.Linear(2, 1)
        >>> state = faccel.TrainState.create(model=model, optimizer=None)
        >>> _ = faccel.checkpoint(faccel.detect({}), state, root, sharded=True)
        >>> out = consolidate(root, tempfile.mkdtemp())
        >>> sorted(p.name for p in out.iterdir())
        ['model.safetensors']
    """
    limit = parse_size(max_shard_size)
    target = spot_of(out)
    folder = latest_checkpoint(checkpoint)
    if folder is None:
        msg = f"{checkpoint}: no checkpoint there (no step-NNNNNNNNNNNN folder with a {MANIFEST})"
        raise CheckpointError(msg)
    blocked = target.store.blocking_file(target.key)
    if blocked is not None:
        msg = f"{blocked} is a file, not a folder: consolidate writes model.safetensors into a folder"
        raise StorageError(msg)
    # The checkpoint is opened and checked first; a run that fails later removes the folder it made.
    specs, read, close = open_weights(spot_of(folder))
    # Holes are a disk's (an object's size, as the store reports it, is bytes it holds: the check
    # passes there by itself).
    if not allow_sparse:
        try:
            _check_backed(spot_of(folder), specs)
        except BaseException:
            close()
            raise
    written: list[Spot] = []
    created = not target.store.is_folder(target.key)
    try:
        try:
            target.store.make_folder(target.key)
            _remove_temporaries(target)
        except OSError as error:
            raise _storage_error(target, error) from error
        held = [e.name for e in target.entries() if e.name.endswith(".safetensors") or e.name == INDEX_NAME]
        if held:
            msg = f"{target} already holds weights ({sorted(held)[:3]}); consolidate into a new folder"
            raise StorageError(msg)
        sizes = {
            name: dtype.itemsize * int(torch.Size(shape).numel()) for name, (dtype, shape) in specs.items()
        }
        groups = split_shards(sizes, limit)
        names = shard_names(len(groups))
        for name, group in zip(names, groups, strict=True):
            header, order = _header(specs, group)
            written.append(target / name)
            _write_file(target / name, header, order, read)
        if len(groups) > 1:
            index = {
                "metadata": {"total_size": sum(sizes.values())},
                "weight_map": {key: name for name, group in zip(names, groups, strict=True) for key in group},
            }
            content = json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"
            written.append(target / INDEX_NAME)
            _write_file(target / INDEX_NAME, content, [], read)
        target.store.sync_folder(target.key)
    except BaseException as error:
        # A failed run leaves nothing of its own: its rerun finds the folder as it was.
        for path in written:
            for each in (path, path.parent / (TMP + path.name)):
                with contextlib.suppress(OSError):
                    target.store.delete(each.key)
        if created and not any(True for _ in target.entries()):
            with contextlib.suppress(OSError):  # only if empty: nothing of anyone else's is removed
                target.store.delete(target.key)
        if isinstance(error, OSError) and not isinstance(error, StorageError):
            raise _storage_error(target, error) from error
        raise
    finally:
        close()
    return shown(target)


def _check_backed(folder: Spot, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Refuse weights that claim far more bytes than the checkpoint's files occupy on disk.

    Each byte written is read from one byte of a file, but a file with holes
    (sparse) reads as zeros it never stored: a forged 144 KB checkpoint once
    consolidated into 2 GiB. Its blocks on disk (``st_blocks``) bound what it
    really holds; twice that plus 64 MiB leaves room for file systems that
    allocate lazily.
    """
    claimed = sum(dtype.itemsize * int(torch.Size(shape).numel()) for dtype, shape in specs.values())
    stored = folder.store.occupied(folder.key)
    if claimed > 2 * stored + (64 << 20):
        msg = (
            f"{folder}: its weights claim {claimed} bytes, but its files occupy {stored} bytes on disk "
            "(they have holes: a forged or damaged checkpoint, or a file system that compresses); "
            "nothing was written. If the checkpoint is yours, pass allow_sparse=True "
            "(python -m faccel consolidate --allow-sparse)"
        )
        raise CheckpointError(msg)


def _remove_temporaries(target: Spot) -> None:
    """Remove what a killed run left (``.tmp-`` files of its own names); a folder there is refused."""
    for entry in target.entries():
        if not entry.name.startswith(TMP):
            continue
        own = entry.name[len(TMP) :]
        if not (own.endswith(".safetensors") or own == INDEX_NAME):
            continue
        path = target / entry.name
        if entry.folder:
            msg = (
                f"{path} is a folder, where consolidate writes its temporary file; "
                "move it away or consolidate into another folder"
            )
            raise StorageError(msg)
        target.store.delete(path.key)


def _storage_error(target: Spot, error: OSError) -> StorageError:
    return StorageError(
        f"consolidating into {target} failed: {error.strerror or error} ({error.filename or target}); "
        "free space or correct the path or permissions, then run it again (nothing of this run was kept)"
    )
