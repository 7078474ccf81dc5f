"""What the object-storage model tests run in worker processes (each first points s3fs at the server)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from tests.distributed.save_model_workers import tiny_gpt2, tokens
from tests.object_store import use


def rows_from_s3(env: Mapping[str, str], url: str) -> dict[str, Any]:
    """FSDP2 on 2 ranks: save_model of a tiny GPT-2 into ``url`` in shards, then load_model from
    ``url`` into a sharded model built from other weights. Returns whether every parameter came back
    bitwise, whether the logits match, and the bytes of tensor data this rank read from the store."""
    import faccel
    from faccel._storage import _objects

    use(env)
    dist = faccel.detect(strategy="fsdp")
    model = faccel.prepare(dist, tiny_gpt2())
    faccel.save_model(dist, model, url, max_shard_size=20_000)
    with torch.no_grad():
        logits = model(tokens()).logits
    fresh = faccel.prepare(dist, tiny_gpt2(seed=1))
    read: list[int] = []
    original = _objects._ObjectReader.read_into

    def counted(self: Any, target: Any, offset: int) -> None:
        read.append(memoryview(target).nbytes)
        original(self, target, offset)

    _objects._ObjectReader.read_into = counted  # type: ignore[method-assign]
    try:
        faccel.load_model(dist, fresh, url)
    finally:
        _objects._ObjectReader.read_into = original  # type: ignore[method-assign]
    with torch.no_grad():
        fresh_logits = fresh(tokens()).logits
    whole = sum(p.full_tensor().numel() * p.element_size() for p in model.parameters())
    return {
        "back": all(
            torch.equal(a.full_tensor(), b.full_tensor())
            for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
        ),
        "logits": torch.equal(fresh_logits, logits),
        "read": sum(read),
        "whole": whole,
    }
