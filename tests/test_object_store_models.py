"""Saved models, stray objects and trackers' folders on object storage, against a real S3 server.

``save_model`` to ``s3://`` and ``load_model`` from it (both layouts; FSDP2 by
rows, each rank reading only its own rows by ranged GETs), and the same bytes
load with ``from_pretrained`` once copied down.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.object_store import S3, moto_server_fixture, s3_fixture  # noqa: F401 - the fixtures

pytest.importorskip("s3fs")
transformers = pytest.importorskip("transformers", reason="needs transformers (in the test extra)")


def _gpt2(seed: int) -> Any:
    from tests.distributed.save_model_workers import tiny_gpt2

    return tiny_gpt2(seed)


@pytest.mark.parametrize("max_shard_size", ["5GB", 30_000])
def test_load_model_reads_a_model_saved_to_s3_and_from_pretrained_its_copy(
    s3: S3, tmp_path: Path, max_shard_size: Any
) -> None:
    import faccel
    from tests.distributed.save_model_workers import tokens

    dist, model = faccel.detect({}), _gpt2(0)
    url = f"{s3.url}/gpt2-{max_shard_size}"
    faccel.save_model(dist, model, url, max_shard_size=max_shard_size)
    fresh = _gpt2(1)
    assert faccel.load_model(dist, fresh, url) == ((), ())
    saved, loaded = model.state_dict(), fresh.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[k], loaded[k]) for k in saved)
    s3.fs().get(f"{url.removeprefix('s3://')}/", str(tmp_path / "down"), recursive=True)
    names = sorted(p.name for p in (tmp_path / "down").iterdir())
    assert ("model.safetensors.index.json" in names) == (max_shard_size != "5GB")
    copied = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "down").eval()
    with torch.no_grad():
        assert torch.equal(copied(tokens()).logits, model(tokens()).logits)


def test_load_model_from_s3_refuses_a_mismatch_and_a_truncated_object(s3: S3) -> None:
    import faccel

    dist, model = faccel.detect({}), torch.nn.Linear(4, 3)
    url = f"{s3.url}/linear"
    faccel.save_model(dist, model, url)
    with pytest.raises(faccel.errors.CheckpointError, match=r"has shape \[3, 4\] in the file, \[3, 5\]"):
        faccel.load_model(dist, torch.nn.Linear(5, 3), url)
    fs, key = s3.fs(), f"{url.removeprefix('s3://')}/model.safetensors"
    fs.pipe_file(key, fs.cat_file(key)[:-4])
    fresh = torch.nn.Linear(4, 3)
    before = fresh.weight.detach().clone()
    with pytest.raises(faccel.errors.CheckpointError, match=r"s3://.*/linear/model.safetensors.*truncated"):
        faccel.load_model(dist, fresh, url)
    assert torch.equal(fresh.weight, before)
    with pytest.raises(faccel.errors.CheckpointError, match=r"neither model.safetensors"):
        faccel.load_model(dist, fresh, f"{s3.url}/nothing-here")


def test_load_model_reads_a_legacy_bin_from_s3(s3: S3) -> None:
    import io

    import faccel

    model = torch.nn.Linear(4, 3)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    s3.fs().pipe_file(f"{s3.url.removeprefix('s3://')}/bin/pytorch_model.bin", buffer.getvalue())
    fresh = torch.nn.Linear(4, 3)
    faccel.load_model(faccel.detect({}), fresh, f"{s3.url}/bin")
    assert torch.equal(fresh.weight, model.weight) and torch.equal(fresh.bias, model.bias)


def test_fsdp2_ranks_load_their_own_rows_from_s3(s3: S3) -> None:
    """2 gloo ranks: save_model to s3:// in shards, load_model from it by rows: bitwise back, and each
    rank read about half of the tensor bytes (its rows, plus the headers)."""
    from tests.distributed import harness
    from tests.distributed import object_model_workers as omw

    results = harness.run(omw.rows_from_s3, world_size=2, timeout=240, env=dict(s3.env), url=f"{s3.url}/fsdp")
    for result in results:
        assert result["back"] and result["logits"], result
        assert result["whole"] * 0.4 < result["read"] < result["whole"] * 0.6, result
