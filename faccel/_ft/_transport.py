"""torchft's checkpoint transport, pickle-free: a live replica's state over the quorum's process group.

torchft 0.2's own transports (HTTP and process group) serialize with ``torch.save`` /
``pickle`` and load with ``weights_only=False``: a peer's bytes could run code. This one
sends the image of ``_peer_state`` (safetensors and tagged JSON, checked against its
BLAKE3 digest before it is parsed) over the same process group, point to point.
"""

from __future__ import annotations

import struct
from datetime import timedelta
from typing import Any

import torch
from torchft.checkpointing.transport import CheckpointTransport

from faccel._ft._peer_state import decode_state, digest_of, encode_state

__all__ = ["PeerTransport"]

# Tags of the two messages of one transfer: the length and digest, then the image.
_HEAD_TAG, _BODY_TAG = 31, 32
_HEAD_BYTES = 8 + 32


class PeerTransport(CheckpointTransport[Any]):
    """Sends and receives a replica's state over the quorum's process group ``pg``."""

    def __init__(self, pg: Any) -> None:
        self._pg = pg

    def metadata(self) -> str:
        # The process group names the peer: nothing else to advertise.
        return "faccel-peer"

    def send_checkpoint(self, dst_ranks: list[int], step: int, state_dict: Any, timeout: timedelta) -> None:
        image = encode_state(state_dict)
        head = torch.frombuffer(
            bytearray(struct.pack("<Q", len(image)) + digest_of(image)), dtype=torch.uint8
        )
        body = torch.frombuffer(bytearray(image), dtype=torch.uint8)
        for dst in dst_ranks:
            self._pg.send([head], dst, tag=_HEAD_TAG).wait(timeout)
            self._pg.send([body], dst, tag=_BODY_TAG).wait(timeout)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: timedelta) -> Any:
        head = torch.empty(_HEAD_BYTES, dtype=torch.uint8)
        self._pg.recv([head], src_rank, tag=_HEAD_TAG).wait(timeout)
        raw = head.numpy().tobytes()
        (size,) = struct.unpack("<Q", raw[:8])
        body = torch.empty(size, dtype=torch.uint8)
        self._pg.recv([body], src_rank, tag=_BODY_TAG).wait(timeout)
        return decode_state(body.numpy().data, raw[8:], where=f"the state from replica rank {src_rank}")
