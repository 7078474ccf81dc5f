"""save_model of an FSDP2 model on 2 gloo ranks: each rank gathers and writes only its share.

One 2-rank run (tests/distributed/save_model_workers.py, ``sharded_gpt2_save``) saves a tiny
GPT-2 with the default max_shard_size, again over it in small shards, and a save whose
writes fail on rank 1. Checked here against a one-process save_model of the same weights.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests.distributed import harness
from tests.distributed import save_model_workers as sw

pytest.importorskip("transformers", reason="needs transformers (in the test extra)")

CONFIGS = ("config.json", "generation_config.json")
SMALL_SHARDS = 20_000  # bytes: the tiny GPT-2's 0.4 MB in more than one file a rank


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    one, two = a.state_dict(), b.state_dict()
    return list(one) == list(two) and all(torch.equal(one[name], two[name]) for name in one)


def _names_in(directory: Path, file: str) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(directory / file), "pt") as handle:
        return set(handle.keys())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    import faccel

    root = tmp_path_factory.mktemp("sharded-save")
    reference = root / "one-process"
    eager = sw.tiny_gpt2()
    faccel.save_model(faccel.detect({}), eager, reference)
    ranks = harness.run(
        sw.sharded_gpt2_save,
        world_size=2,
        timeout=150,
        directory=str(root),
        small_shards=SMALL_SHARDS,
        failing=str(root / "failing"),
    )
    return {"root": root, "reference": reference, "eager": eager, "ranks": ranks}


def _plan(reference: Path) -> tuple[dict[str, int], dict[str, int]]:
    """The tensors' bytes, in the model's order, and the rank faccel's plan gives each."""
    from faccel._hf._assign import assign
    from faccel._storage._weights import model_tensors

    stored, _ = model_tensors(sw.tiny_gpt2())
    sizes = {name: t.numel() * t.element_size() for name, t in stored.items()}
    return sizes, assign(sizes, 2)


def test_each_rank_writes_only_its_share_and_the_tensors_equal_a_one_process_save(saved: dict) -> None:
    folder, reference = saved["root"] / "default", saved["reference"]
    want = sw.hf_tensors(reference)
    sizes, owner = _plan(reference)
    assert set(sizes) == set(want)  # the tied lm_head.weight stored once, as in one process
    assert "lm_head.weight" not in want
    got = sw.hf_tensors(folder)
    assert set(got) == set(want)
    for name, tensor in want.items():  # bitwise, dtype and shape included
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2  # small shards: more than one file a rank
    # the second save replaced the first: one tag, no temporaries, nothing the index does not name
    assert len({re.sub(r"-\d{5}-of-\d{5}.*", "", file) for file in files}) == 1
    assert sorted(os.listdir(folder)) == sorted([*files, "model.safetensors.index.json", *CONFIGS])
    written = [rank["small_files"] for rank in saved["ranks"]]
    assert sorted(written[0] + written[1]) == files  # every file written by exactly one rank
    for rank, own in enumerate(written):
        held = set().union(*(_names_in(folder, file) for file in own))
        assert held == {name for name, r in owner.items() if r == rank}, rank
        load = sum(sizes[name] for name in held)
        assert load <= sum(sizes.values()) / 2 + max(sizes.values())


def test_the_default_shard_size_writes_one_file_per_writing_rank(saved: dict) -> None:
    # Recorded before the second save replaced them: one file a rank, numbered rank by rank.
    first, second = (rank["default_files"] for rank in saved["ranks"])
    assert len(first) == 1 and len(second) == 1
    assert re.fullmatch(r"model-[0-9a-f]{8}-00001-of-00002\.safetensors", first[0])
    assert re.fullmatch(r"model-[0-9a-f]{8}-00002-of-00002\.safetensors", second[0])
    assert first[0][:14] == second[0][:14]  # one save, one tag


def test_from_pretrained_and_load_model_read_it_with_the_prepared_model_s_logits(saved: dict) -> None:
    import transformers

    import faccel

    folder, eager = saved["root"] / "default", saved["eager"]
    tokens = sw.tokens()
    with torch.no_grad():
        eager_logits = eager(tokens).logits
        loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again
        assert torch.equal(loaded(tokens).logits, eager_logits)
    for rank in saved["ranks"]:
        prepared = torch.tensor(rank["logits"]).reshape(eager_logits.shape)
        assert torch.equal(prepared, eager_logits)  # FSDP2 gathers the same weights: the same sums
        assert rank["fresh_logits_equal"] and rank["loaded_back"]  # load_model into a sharded model
    plain = sw.tiny_gpt2(seed=1)
    assert faccel.load_model(faccel.detect({}), plain, folder) == ((), ())
    assert _same(plain, eager)


def test_a_write_failing_on_one_rank_fails_every_rank_and_leaves_the_earlier_save(saved: dict) -> None:
    import faccel

    failing, eager = saved["root"] / "failing", saved["eager"]
    first, second = (rank["failure"] for rank in saved["ranks"])
    assert "No space left on device (injected)" in second and "rank 1" in second
    assert "failed on 1 other rank(s)" in first
    plain = sw.tiny_gpt2(seed=1)
    faccel.load_model(faccel.detect({}), plain, failing)  # the earlier save, not the +1 of the failed one
    assert _same(plain, eager)
    names = os.listdir(failing)
    assert not [name for name in names if name.startswith(".tmp-")]
    index = json.loads((failing / "model.safetensors.index.json").read_text())
    assert sorted(names) == sorted(
        [*set(index["weight_map"].values()), "model.safetensors.index.json", *CONFIGS]
    )


def test_a_plan_of_one_file_is_model_safetensors(saved: dict) -> None:
    folder = saved["root"] / "single"
    assert sorted(os.listdir(folder)) == ["model.safetensors"]
    weight = sw.hf_tensors(folder)["weight"]
    assert weight.shape == (6, 8)
    assert (
        weight.flatten().tolist() == saved["ranks"][0]["single_weight"] == saved["ranks"][1]["single_weight"]
    )
