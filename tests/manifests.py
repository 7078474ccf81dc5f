"""Editing a checkpoint's manifest in tests: the digests computed here, independently of faccel.

A test that changes a file on purpose (a wrong but consistent checkpoint, not a corrupted one)
rehashes it in the manifest with the hash the manifest's version records: SHA-256 in versions 1
(whole tensors) and 2 (sharded), BLAKE3 in version 3 (whole tensors).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import blake3

HASH_OF_VERSION = {1: "sha256", 2: "sha256", 3: "blake3"}


def digest(algorithm: str, data: bytes) -> str:
    """The hex digest of ``data`` under ``algorithm`` ("sha256" or "blake3")."""
    made = {"sha256": hashlib.sha256, "blake3": blake3.blake3}[algorithm](data)
    return made.hexdigest()


def entry_of(manifest: dict[str, Any], data: bytes) -> dict[str, Any]:
    """The manifest entry ``data`` has in ``manifest``'s version."""
    algorithm = HASH_OF_VERSION[manifest["version"]]
    return {"size": len(data), algorithm: digest(algorithm, data)}


def rehash(folder: Path, name: str) -> None:
    """Make ``folder``'s manifest agree with ``name``'s bytes as they are now."""
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = entry_of(manifest, (folder / name).read_bytes())
    (folder / "manifest.json").write_text(json.dumps(manifest))


def matches(manifest: dict[str, Any], entry: dict[str, Any], data: bytes) -> bool:
    """Whether ``data`` is the file ``entry`` (of ``manifest``) records."""
    return entry == entry_of(manifest, data)
