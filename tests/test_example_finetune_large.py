"""examples/finetune_large.py on 2 processes: a GPT-2 built on meta from its config, sharded (FSDP2),
loaded by rows from a ``save_pretrained`` folder, fine-tuned, checkpointed, resumed and exported; the
export loads with ``from_pretrained`` with the fine-tuned model's logits, bit for bit. And a Llama,
whose rotary table is computed, not loaded.

Small and offline: the test writes the starting folder itself (a 2-layer GPT-2 of width 32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.budget import example_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "finetune_large.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(*args: str) -> str:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [sys.executable, *launcher, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=ROOT,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    return output


def _logits(folder: Path, ids: object) -> object:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits


@example_run
def test_two_processes_load_by_rows_fine_tune_checkpoint_resume_and_export(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the example needs transformers")
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    start, out = tmp_path / "start", tmp_path / "out"
    transformers.GPT2LMHeadModel(config).save_pretrained(start)

    first = _run("--model_dir", str(start), "--output_dir", str(out), "--steps", "8")
    done = json.loads(first.split("done: ", 1)[1].splitlines()[0])
    assert done["step"] == 8 and "replicate=1,shard=2,tensor=1" in first  # the plan, printed first
    losses = [float(line.rsplit(" ", 1)[1]) for line in first.splitlines() if ": loss " in line]
    assert len(losses) == 8 and losses[-1] < losses[0]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "step-000000000004",
        "step-000000000008",
    ]
    probe = (torch.arange(32).view(2, 16) * 7) % 64
    written = load_file(out / "logits.safetensors")
    assert torch.equal(written["loaded"], _logits(start, probe))  # load_model read START exactly
    assert torch.equal(written["final"], _logits(out, probe))  # the export is the fine-tuned model
    assert not torch.equal(written["final"], written["loaded"])

    second = _run("--model_dir", str(start), "--output_dir", str(out), "--steps", "10")
    assert "resumed from step 8" in second and "step 9: loss" in second and "step 1: loss" not in second
    assert json.loads(second.split("done: ", 1)[1].splitlines()[0])["step"] == 10
    assert torch.equal(load_file(out / "logits.safetensors")["final"], _logits(out, probe))


def test_a_llama_with_a_computed_rotary_table_loads_trains_and_exports(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers", reason="the example needs transformers")
    import torch
    from safetensors.torch import load_file

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=32,
    )
    start, out = tmp_path / "start", tmp_path / "out"
    transformers.LlamaForCausalLM(config).save_pretrained(start)
    _run("--model_dir", str(start), "--output_dir", str(out), "--steps", "2", "--checkpoint_every", "2")
    probe = (torch.arange(32).view(2, 16) * 7) % 64
    written = load_file(out / "logits.safetensors")
    # The rotary table (inv_freq, in no weights file) came out right: else the logits would differ.
    assert torch.equal(written["loaded"], _logits(start, probe))
    assert torch.equal(written["final"], _logits(out, probe))
