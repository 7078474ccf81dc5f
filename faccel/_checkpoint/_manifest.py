"""The checkpoint's manifest and rank pages as typed records, each with one encode and one decode.

``manifest.json`` is the first file a reader reads and the last a writer writes (its commit):
:class:`Manifest` holds what it says (format version, step, epoch, position, world size, and
every listed file's size and hash), :meth:`Manifest.encode` is its JSON object, and
:meth:`Manifest.decode` the only place that reads one, checking the format, the version, the
world size and the file list before any other file is opened. :func:`read_manifest` reads and
decodes one folder's manifest (``consolidate``, the weights reader); ``restore`` reads it through
``_folders.read_folder_manifest``, which decodes it with the same :meth:`Manifest.decode`, once.
:class:`RankPage` is the same for the sharded
format's rank pages. The keys of these files are spelled here only; the file names and versions
are ``_format``'s.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from faccel._checkpoint._format import (
    FILE_HASH,
    FORMAT,
    MANIFEST,
    MAX_SHARDED_WORLD,
    PAGE_RANKS,
    RANKS_FORMAT,
    VERSION_SHARDED,
    WHOLE_VERSIONS,
    expected_files,
    file_records,
    manifest_version,
)
from faccel._storage._durable import MAX_MANIFEST, SHA256, FileRecord, parse_json
from faccel._storage._roots import spot_of
from faccel._storage._store import Spot
from faccel.errors import CheckpointError

__all__ = ["Manifest", "RankPage", "read_manifest", "step_of"]


@attrs.frozen(kw_only=True)
class Manifest:
    """What ``manifest.json`` says: the checkpoint's version, position and every file's record.

    ``epoch`` and ``position`` are kept as written (``state.json`` holds the checked ones);
    ``data_world_size`` is None where it equals ``world_size``.

    Example:
        >>> from faccel._storage._durable import FileRecord
        >>> record = FileRecord(size=1, digest="00", algorithm="sha256")
        >>> files = {name: record for name in ("state.json", "extras.safetensors", "ranks-00000.json")}
        >>> manifest = Manifest(version=2, step=3, epoch=0, position=0, world_size=2, files=files)
        >>> Manifest.decode(manifest.encode(), where="m") == manifest
        True
    """

    version: int
    step: Any
    epoch: Any
    position: Any
    world_size: int
    files: Mapping[str, FileRecord]
    data_world_size: int | None = None
    torch_version: str = attrs.field(factory=lambda: torch.__version__)

    @property
    def data_world(self) -> int:
        """The data-parallel ranks that counted ``position`` (the world size unless recorded)."""
        return self.world_size if self.data_world_size is None else self.data_world_size

    def encode(self) -> dict[str, Any]:
        """The JSON object of ``manifest.json``: each file's entry names its hash as the version does.

        Version 2 lists one rank page per ``PAGE_RANKS`` ranks: about 100 bytes per 1,024 ranks,
        at most 1,024 pages (``MAX_SHARDED_WORLD`` ranks).
        """
        algorithm = FILE_HASH[self.version]
        names = expected_files(self.world_size, self.version)
        assert all(self.files[name].algorithm == algorithm for name in names)
        return {
            "format": FORMAT,
            "version": self.version,
            "step": self.step,
            "epoch": self.epoch,
            "position": self.position,
            "world_size": self.world_size,
            # Only when a layout deals the data over fewer ranks (tensor parallelism).
            **(
                {"data_world_size": self.data_world_size}
                if self.data_world_size not in (None, self.world_size)
                else {}
            ),
            "torch_version": self.torch_version,
            "files": {
                name: {"size": self.files[name].size, algorithm: self.files[name].digest} for name in names
            },
        }

    @classmethod
    def decode(cls, raw: Any, *, where: str) -> Manifest:
        """A parsed ``manifest.json`` checked (format, version, world size, the file list), or
        :class:`CheckpointError` naming ``where`` and what is wrong."""
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            msg = f"{where}: not a faccel checkpoint manifest (format should be {FORMAT!r})"
            raise CheckpointError(msg)
        version = manifest_version(raw, where=where)
        world = raw.get("world_size")
        if type(world) is not int or world < 1:
            msg = f"{where}: world_size should be a positive int, got {world!r}"
            raise CheckpointError(msg)
        if version == VERSION_SHARDED and world > MAX_SHARDED_WORLD:
            msg = f"{where}: world_size {world} is over the sharded format's {MAX_SHARDED_WORLD:,} ranks"
            raise CheckpointError(msg)
        files = raw.get("files")
        if not isinstance(files, dict):
            files = {}
        listed = set(files)
        # Bounds world_size by what the manifest lists, before naming the files.
        whole = version in WHOLE_VERSIONS
        room = len(listed) if whole else (len(listed) - 2) * PAGE_RANKS
        if world > room:
            per = "one generator file per rank" if whole else f"one rank page per {PAGE_RANKS} ranks"
            msg = f"{where}: world_size {world}, but it lists {len(listed)} files ({per})"
            raise CheckpointError(msg)
        expected = set(expected_files(world, version))
        if listed != expected:
            msg = (
                f"{where}: lists files {sorted(listed)}, a checkpoint of {world} rank(s) has "
                f"{sorted(expected)}"
            )
            raise CheckpointError(msg)
        data_world = raw.get("data_world_size")
        return cls(
            version=version,
            step=raw.get("step"),
            epoch=raw.get("epoch"),
            position=raw.get("position"),
            world_size=world,
            files=file_records(files, version, where=where),
            data_world_size=data_world if data_world != world else None,
            torch_version=str(raw.get("torch_version", "")),
        )


def read_manifest(directory: Spot | Path) -> Manifest:
    """``directory``'s manifest, read (at most ``MAX_MANIFEST`` bytes, a regular file) and decoded:
    (``consolidate``, the weights reader; ``restore``'s is ``_folders.read_folder_manifest``), on any
    store."""
    folder = spot_of(directory)
    where = str(folder / MANIFEST)
    buffer, _ = (folder / MANIFEST).read(None, where=where, limit=MAX_MANIFEST)
    return Manifest.decode(parse_json(buffer.numpy().tobytes(), where), where=where)


def step_of(raw: Any, *, where: str) -> int | str:
    """The step a parsed manifest names, or why it names none that counts (not faccel's, or not an
    int): what tells a complete checkpoint folder, without the checks of :meth:`Manifest.decode`.

    Example:
        >>> step_of({"format": "faccel.checkpoint", "step": 7}, where="m")
        7
    """
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        return f"{where}: not a faccel manifest (its format is not {FORMAT!r})"
    step = raw.get("step")
    return step if type(step) is int else f"{where}: its step is not an integer, got {step!r}"


@attrs.frozen(kw_only=True)
class RankPage:
    """One rank page of the sharded format: the ``(shard, rng)`` records of ranks ``first`` on.

    Example:
        >>> from faccel._storage._durable import FileRecord
        >>> record = FileRecord(size=8, digest="ab", algorithm="sha256")
        >>> page = RankPage(first=0, ranks=((record, record),))
        >>> page.encode()["ranks"]
        [{'shard': {'size': 8, 'sha256': 'ab'}, 'rng': {'size': 8, 'sha256': 'ab'}}]
        >>> RankPage.decode(page.encode(), first=0, count=1, where="p") == page
        True
    """

    first: int
    ranks: Sequence[tuple[FileRecord, FileRecord]]

    def encode(self) -> dict[str, Any]:
        """The JSON object of the page's file."""
        return {
            "format": RANKS_FORMAT,
            "first": self.first,
            "ranks": [
                {"shard": {"size": s.size, SHA256: s.digest}, "rng": {"size": r.size, SHA256: r.digest}}
                for s, r in self.ranks
            ],
        }

    @classmethod
    def decode(cls, raw: Any, *, first: int, count: int, where: str) -> RankPage:
        """A parsed rank page, checked to be the page of ranks ``first`` to ``first + count - 1``."""
        entries = raw.get("ranks") if isinstance(raw, dict) else None
        if (
            not isinstance(raw, dict)
            or raw.get("format") != RANKS_FORMAT
            or raw.get("first") != first
            or not isinstance(entries, list)
            or len(entries) != count
        ):
            msg = f"{where}: not the rank page of ranks {first} to {first + count - 1}"
            raise CheckpointError(msg)
        out = []
        for entry in entries:
            try:
                pair = tuple(
                    FileRecord(size=entry[k]["size"], digest=entry[k][SHA256], algorithm=SHA256)
                    for k in ("shard", "rng")
                )
            except (KeyError, TypeError):
                msg = f"{where}: every rank needs shard and rng records of a size and a sha256"
                raise CheckpointError(msg) from None
            if not all(type(r.size) is int and isinstance(r.digest, str) for r in pair):
                msg = f"{where}: every rank needs shard and rng records of a size and a sha256"
                raise CheckpointError(msg)
            out.append((pair[0], pair[1]))
        return cls(first=first, ranks=tuple(out))
