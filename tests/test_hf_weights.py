"""save_model writes what from_pretrained needs; load_model reads the legacy pytorch_model.bin safely."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


def _tiny_gpt2():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers", reason="needs transformers (in the test extra)")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=64)
    torch.manual_seed(0)
    return transformers, transformers.GPT2LMHeadModel(config).eval()


def test_save_model_writes_what_from_pretrained_needs_and_the_logits_match_exactly(tmp_path: Path) -> None:
    import faccel

    transformers, model = _tiny_gpt2()
    dist = faccel.detect({})
    faccel.save_model(dist, faccel.prepare(dist, model), tmp_path / "gpt2")
    names = {p.name for p in (tmp_path / "gpt2").iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json"} <= names
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    tokens = torch.randint(0, 101, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
    assert json.loads((tmp_path / "gpt2" / "config.json").read_text())["n_layer"] == 2


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _zeroed() -> torch.nn.Module:
    model = _mlp()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return model


def test_load_model_reads_a_legacy_pytorch_model_bin(tmp_path: Path) -> None:
    import faccel

    source = _mlp()
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    target = _zeroed()
    faccel.load_model(faccel.detect({}), target, tmp_path)
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)


def test_load_model_reads_a_sharded_bin_with_its_index(tmp_path: Path) -> None:
    import faccel

    source = _mlp()
    state = source.state_dict()
    first = {k: v for k, v in state.items() if k.startswith("0.")}
    second = {k: v for k, v in state.items() if k.startswith("2.")}
    torch.save(first, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save(second, tmp_path / "pytorch_model-00002-of-00002.bin")
    weight_map = {k: "pytorch_model-00001-of-00002.bin" for k in first} | {
        k: "pytorch_model-00002-of-00002.bin" for k in second
    }
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    target = _zeroed()
    faccel.load_model(faccel.detect({}), target, tmp_path)
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)


class _Payload:
    """Unpickling this would run code: it must never be unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (Path.touch, (Path(self.marker),))


def test_a_bin_holding_anything_but_tensors_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    import faccel

    marker = tmp_path / "ran"
    torch.save({"0.weight": _Payload(str(marker))}, tmp_path / "pytorch_model.bin")
    target = _zeroed()
    with pytest.raises(faccel.errors.CheckpointError, match=r"pytorch_model\.bin"):
        faccel.load_model(faccel.detect({}), target, tmp_path)
    assert not marker.exists()
    assert all(not p.any() for p in target.parameters())  # nothing loaded


def test_a_bin_with_missing_keys_is_refused_like_safetensors(tmp_path: Path) -> None:
    import faccel

    state = _mlp().state_dict()
    del state["2.bias"]
    torch.save(state, tmp_path / "pytorch_model.bin")
    target = _zeroed()
    with pytest.raises(faccel.errors.CheckpointError, match=r"2\.bias"):
        faccel.load_model(faccel.detect({}), target, tmp_path)
    assert all(not p.any() for p in target.parameters())


def test_convert_writes_the_safetensors_layout(tmp_path: Path) -> None:
    import subprocess
    import sys

    import faccel

    source = _mlp()
    torch.save(source.state_dict(), tmp_path / "pytorch_model.bin")
    subprocess.run(
        [sys.executable, "-m", "faccel", "convert", str(tmp_path), str(tmp_path / "out")],
        check=True,
        capture_output=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert (tmp_path / "out" / "model.safetensors").exists()
    target = _zeroed()
    faccel.load_model(faccel.detect({}), target, tmp_path / "out")
    for a, b in zip(source.parameters(), target.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("views", "refusal"),
    [
        # 1,619 bytes on disk that convert wrote as 512 MiB (2^42 elements: a raw
        # RuntimeError of the allocator).
        (lambda: {"w": torch.zeros(1).expand(2**27)}, "a view whose elements overlap"),
        (lambda: {"w": torch.zeros(1).expand(2**42)}, "a view whose elements overlap"),
        (lambda: {"w": torch.zeros(8).as_strided((4, 4), (1, 1))}, "a view whose elements overlap"),
        (lambda: (lambda base: {"a": base[:6], "b": base[2:]})(torch.zeros(8)), "views of overlapping bytes"),
    ],
)
def test_bin_views_that_would_write_more_than_they_hold_are_refused(
    tmp_path: Path, views: Callable[[], dict[str, torch.Tensor]], refusal: str
) -> None:
    import faccel
    from faccel._hf._save_model import convert_weights

    torch.save(views(), tmp_path / "pytorch_model.bin")
    assert (tmp_path / "pytorch_model.bin").stat().st_size < 4096
    with pytest.raises(faccel.errors.CheckpointError, match=refusal):
        convert_weights(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out" / "model.safetensors").exists()
    with pytest.raises(faccel.errors.CheckpointError, match=refusal):
        faccel.load_model(faccel.detect({}), torch.nn.Linear(2, 2), tmp_path, strict=False)


def test_bin_views_of_disjoint_bytes_and_tied_names_convert_exactly(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    from faccel._hf._save_model import convert_weights

    base = torch.arange(8.0)
    torch.save({"a": base[:3], "b": base[3:], "tied": base[:3]}, tmp_path / "pytorch_model.bin")
    out = convert_weights(tmp_path, tmp_path / "out")
    written = load_file(out / "model.safetensors")
    assert set(written) <= {"a", "b", "tied"} and torch.equal(written["b"], base[3:])
    assert torch.equal(written.get("a", written.get("tied")), base[:3])
