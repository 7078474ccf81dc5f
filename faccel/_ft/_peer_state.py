"""A live replica's state as bytes and back: the checkpoint format, without a file.

A healing replica receives the state a checkpoint would hold, in the same encoding:
tensors in one safetensors image (``_storage/_safetensors.py``), everything else as
tagged JSON in its metadata (``_storage/_tagged_json.py``), the whole image hashed
with BLAKE3 as a checkpoint's files are (``_storage/_durable.py``). No pickle: the
receiver parses only what :func:`encode` can write, and checks the hash before it
parses a byte.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from faccel._storage._durable import BLAKE3, new_hash, parse_json
from faccel._storage._safetensors import parse_header, plan, tensor_views
from faccel._storage._tagged_json import TensorSink, decode, encode
from faccel.errors import CheckpointError

__all__ = ["decode_state", "digest_of", "encode_state"]

_FILE = "peer"
_STATE_KEY = "state"


def digest_of(image: bytes | memoryview) -> bytes:
    """The image's BLAKE3 digest (32 bytes), the hash faccel's checkpoint files carry.

    Example:
        >>> len(digest_of(b"abc"))
        32
    """
    hasher = new_hash(BLAKE3)
    hasher.update(image)
    return bytes.fromhex(hasher.hexdigest())


def encode_state(state: Any) -> bytes:
    """``state`` (a tree of JSON values and tensors) as one safetensors image.

    Example:
        >>> image = encode_state({"w": torch.ones(2), "step": 3})
        >>> decode_state(image, digest_of(image), where="peer")["step"]
        3
    """
    sink = TensorSink(file=_FILE)
    tree = encode(state, sink=sink)
    text = json.dumps(tree, separators=(",", ":"), allow_nan=False)
    return b"".join(bytes(chunk) for chunk in plan(sink.tensors, metadata={_STATE_KEY: text}))


def decode_state(image: bytes | memoryview, digest: bytes, *, where: str) -> Any:
    """The tree :func:`encode_state` wrote, after checking the image against ``digest``.

    Raises:
        CheckpointError: The image does not match its digest, or is not one that
            :func:`encode_state` writes.

    Example:
        >>> image = encode_state({"w": torch.zeros(1)})
        >>> decode_state(image, bytes(32), where="replica 0")
        Traceback (most recent call last):
        ...
        faccel.errors.CheckpointError: replica 0: the state received does not match its BLAKE3 digest (...
    """
    got = digest_of(image)
    if got != digest:
        msg = (
            f"{where}: the state received does not match its BLAKE3 digest (expected "
            f"{digest.hex()[:16]}..., received bytes hashing to {got.hex()[:16]}...); it was damaged "
            "in transit: the replica heals again at the next quorum"
        )
        raise CheckpointError(msg)
    header = parse_header(image, len(image), where=where)
    if _STATE_KEY not in header.metadata:
        msg = f"{where}: the state received has no {_STATE_KEY!r} entry in its metadata"
        raise CheckpointError(msg)
    buffer = torch.frombuffer(bytearray(image), dtype=torch.uint8)
    tensors = {name: view.clone() for name, view in tensor_views(buffer, header).items()}
    tree = parse_json(header.metadata[_STATE_KEY].encode(), where)
    return decode(tree, tensors={_FILE: tensors}, where=where)
