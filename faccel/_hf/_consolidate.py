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
from typing import Any

import torch

from faccel._checkpoint._folders import latest_checkpoint
from faccel._checkpoint._format import (
    FORMAT,
    MANIFEST,
    MODEL,
    MODEL_METADATA,
    STATE,
    VERSION_SHARDED,
    file_records,
    manifest_version,
    shard_name,
)
from faccel._checkpoint._sharded._chunks import Placed, chunks, parse_index, rows_of
from faccel._checkpoint._sharded._flow import Pages
from faccel._checkpoint._sharded._shard_file import ShardFile, byte_view, empty_rows
from faccel._hf._naming import INDEX_NAME, parse_size, shard_names, split_shards
from faccel._storage._durable import (
    MAX_JSON,
    MAX_MANIFEST,
    FileRecord,
    SyncedWriter,
    fsync_dir,
    new_hash,
    open_regular,
    parse_json,
    read_json,
    read_verified,
)
from faccel._storage._safetensors import header_bytes, header_of_open, read_open
from faccel.errors import CheckpointError, StorageError

__all__ = ["consolidate"]

_READ_CHUNK = 64 << 20


def _specs_and_reader(
    folder: Path,
) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...]]], Callable[[str], torch.Tensor], Callable[[], None]]:
    """The model tensors' ``(dtype, shape)``, a function that reads one whole, and one that closes."""
    where = str(folder / MANIFEST)
    manifest = read_json(folder / MANIFEST, where=where, limit=MAX_MANIFEST)
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or not isinstance(manifest.get("files"), dict)
    ):
        msg = f"{where}: not a faccel checkpoint manifest"
        raise CheckpointError(msg)
    version = manifest_version(manifest, where=where)
    records = file_records(manifest["files"], version, where=where)
    if version != VERSION_SHARDED:
        path = folder / MODEL
        # One open file from the hash on: a replace=True save renamed in meanwhile cannot mix in.
        fd = _open_checked(path, records.get(MODEL))
        try:
            header = header_of_open(fd, where=str(path))
        except BaseException:
            os.close(fd)
            raise
        specs = {name: (info.dtype, info.shape) for name, info in header.tensors.items()}
        return (
            specs,
            lambda name: read_open(fd, header, {name: header.tensors[name]}, where=str(path))[name],
            lambda: os.close(fd),
        )
    world = manifest.get("world_size")
    if type(world) is not int or world < 1:
        msg = f"{where}: world_size should be a positive int"
        raise CheckpointError(msg)
    buffer, _ = read_verified(folder / STATE, records.get(STATE), where=str(folder / STATE), limit=MAX_JSON)
    content = parse_json(buffer.numpy().tobytes(), str(folder / STATE))
    index = parse_index(
        content.get("tensors") if isinstance(content, dict) else None, world, where=str(folder)
    )
    model: dict[str, Placed] = index.get("model", {})
    pages = Pages(folder, records, world)
    opened: dict[int, ShardFile] = {}
    scratch: dict[str, Any] = {}  # one thread reads: its buffers kept from tensor to tensor

    def read(name: str) -> torch.Tensor:
        placed = model[name]
        for chunk in chunks(placed, world):  # sizes checked against the files before anything is allocated
            if chunk.rank not in opened:
                path = folder / shard_name(chunk.rank)
                step = content.get("step") if isinstance(content, dict) else None
                opened[chunk.rank] = ShardFile(path, pages.of(chunk.rank)[0], where=str(path), step=step)
            opened[chunk.rank].info(f"model/{name}", placed, chunk)
        out = empty_rows(placed, 0, rows_of(placed.shape))
        view = byte_view(out)
        width = len(view) // max(1, rows_of(placed.shape))
        for chunk in chunks(placed, world):
            part = view[chunk.start * width : chunk.stop * width]
            opened[chunk.rank].read(f"model/{name}", placed, chunk, part, scratch)
        return out

    def close() -> None:
        for shard in opened.values():
            shard.close()

    return {name: (p.dtype, p.shape) for name, p in model.items()}, read, close


def _open_checked(path: Path, record: FileRecord | None) -> int:
    """A whole-tensor model file, open, its size and hash checked against the manifest in bounded
    pieces; the caller reads the tensors from this descriptor and closes it."""
    where = str(path)
    if record is None:
        msg = f"{path.parent}/{MANIFEST}: does not list {MODEL}"
        raise CheckpointError(msg)
    fd = open_regular(path, where=where)
    try:
        if os.fstat(fd).st_size != record.size:
            msg = f"{where}: the file's size differs from the manifest's (truncated or altered)"
            raise CheckpointError(msg)
        digest = new_hash(record.algorithm)
        while chunk := os.read(fd, _READ_CHUNK):
            digest.update(chunk)
        if digest.hexdigest() != record.digest:
            msg = f"{where}: the {record.algorithm} checksum differs from the manifest's (corrupted)"
            raise CheckpointError(msg)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _header(
    specs: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], names: list[str]
) -> tuple[bytes, list[str]]:
    """A safetensors header for ``names`` (largest element size first, as faccel writes) and the order."""
    order = sorted(names, key=lambda name: -specs[name][0].itemsize)
    return header_bytes(specs, order, MODEL_METADATA), order


def _write_file(path: Path, header: bytes, order: list[str], read: Callable[[str], torch.Tensor]) -> None:
    temporary = path.with_name(f".tmp-{path.name}")
    temporary.unlink(missing_ok=True)
    with SyncedWriter(temporary) as out:
        out.write(header)
        for name in order:
            tensor = read(name)  # one tensor in memory at a time
            out.write(byte_view(tensor))
            del tensor
        out.close()
    os.replace(temporary, path)


def consolidate(
    checkpoint: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    allow_sparse: bool = False,
) -> Path:
    """Write a checkpoint's model weights to ``out`` in the Hugging Face layout, one tensor at a time.

    ``python -m faccel consolidate CKPT OUT``. ``checkpoint`` is a checkpoint
    folder, or a root of them (its latest). No process group is needed, and
    any world size may have written it. Peak memory is about the largest
    tensor. The output is what :func:`faccel.save_model` writes for the model.

    Args:
        checkpoint: A checkpoint folder or a root folder of checkpoints.
        out: A new (or empty of weights) folder to write into.
        max_shard_size: Largest output file, in bytes or as text (``"5GB"``).
        allow_sparse: Write the weights even when they claim more than twice the
            bytes the checkpoint's files occupy on disk (plus 64 MiB): files with
            holes, as a forged checkpoint has, or a file system that compresses.

    Returns:
        ``out``.

    Raises:
        CheckpointError: No checkpoint there, or a file that fails its checks;
            weights that claim more than the files occupy (see ``allow_sparse``),
            before anything is written.
        StorageError: ``out`` is a file, or already holds weights.

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
    folder = latest_checkpoint(checkpoint)
    if folder is None:
        msg = f"{checkpoint}: no checkpoint there (no step-NNNNNNNNNNNN folder with a {MANIFEST})"
        raise CheckpointError(msg)
    if not isinstance(folder, Path):
        msg = (
            f"{folder}: consolidate reads a checkpoint on a local disk; copy it from object storage "
            "first (the same bytes restore there, docs/object-storage.md)"
        )
        raise CheckpointError(msg)
    target = Path(out)
    if target.exists() and not target.is_dir():
        msg = f"{target} is a file, not a folder: consolidate writes model.safetensors into a folder"
        raise StorageError(msg)
    # The checkpoint is opened and checked first; a run that fails later removes the folder it made.
    specs, read, close = _specs_and_reader(folder)
    if not allow_sparse:
        try:
            _check_backed(folder, specs)
        except BaseException:
            close()
            raise
    written: list[Path] = []
    created = not target.exists()
    try:
        try:
            target.mkdir(parents=True, exist_ok=True)
            _remove_temporaries(target)
        except OSError as error:
            raise _storage_error(target, error) from error
        held = [name for name in os.listdir(target) if name.endswith(".safetensors") or name == INDEX_NAME]
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
        fsync_dir(target)
    except BaseException as error:
        # A failed run leaves nothing of its own: its rerun finds the folder as it was.
        for path in written:
            for each in (path, path.with_name(f".tmp-{path.name}")):
                with contextlib.suppress(OSError):
                    each.unlink()
        if created:
            with contextlib.suppress(OSError):  # only if empty: nothing of anyone else's is removed
                target.rmdir()
        if isinstance(error, OSError) and not isinstance(error, StorageError):
            raise _storage_error(target, error) from error
        raise
    finally:
        close()
    return target


def _check_backed(folder: Path, specs: dict[str, tuple[torch.dtype, tuple[int, ...]]]) -> None:
    """Refuse weights that claim far more bytes than the checkpoint's files occupy on disk.

    Each byte written is read from one byte of a file, but a file with holes
    (sparse) reads as zeros it never stored: a forged 144 KB checkpoint once
    consolidated into 2 GiB. Its blocks on disk (``st_blocks``) bound what it
    really holds; twice that plus 64 MiB leaves room for file systems that
    allocate lazily.
    """
    claimed = sum(dtype.itemsize * int(torch.Size(shape).numel()) for dtype, shape in specs.values())
    stored = 0
    for entry in os.scandir(folder):
        if entry.is_file(follow_symlinks=False):
            stat = entry.stat(follow_symlinks=False)
            stored += min(stat.st_size, getattr(stat, "st_blocks", stat.st_size // 512 + 1) * 512)
    if claimed > 2 * stored + (64 << 20):
        msg = (
            f"{folder}: its weights claim {claimed} bytes, but its files occupy {stored} bytes on disk "
            "(they have holes: a forged or damaged checkpoint, or a file system that compresses); "
            "nothing was written. If the checkpoint is yours, pass allow_sparse=True "
            "(python -m faccel consolidate --allow-sparse)"
        )
        raise CheckpointError(msg)


def _remove_temporaries(target: Path) -> None:
    """Remove what a killed run left (``.tmp-`` files of its own names); a folder there is refused."""
    for name in os.listdir(target):
        if not name.startswith(".tmp-"):
            continue
        own = name[len(".tmp-") :]
        if not (own.endswith(".safetensors") or own == INDEX_NAME):
            continue
        path = target / name
        if path.is_dir() and not path.is_symlink():
            msg = (
                f"{path} is a folder, where consolidate writes its temporary file; "
                "move it away or consolidate into another folder"
            )
            raise StorageError(msg)
        path.unlink()


def _storage_error(target: Path, error: OSError) -> StorageError:
    return StorageError(
        f"consolidating into {target} failed: {error.strerror or error} ({error.filename or target}); "
        "free space or correct the path or permissions, then run it again (nothing of this run was kept)"
    )
