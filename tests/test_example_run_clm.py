"""examples/run_clm.py (transformers' run_clm_no_trainer.py on faccel): one process and two, a SIGKILL
mid-epoch and a resume that ends with the uninterrupted run's weights bit for bit, the saved folder
loaded by ``from_pretrained``, and the same loop under Accelerate ending with the same weights.

Offline and small: a generated text file, a word-level tokenizer trained on it, a 2-layer GPT-2 of
width 32, blocks of 16 tokens, 2 epochs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.budget import example_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "run_clm.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
MODEL = "n_layer=2,n_embd=32,n_head=2,n_positions=64,vocab_size=30,bos_token_id=1,eos_token_id=1"
NO_DROPOUT = ",resid_pdrop=0,embd_pdrop=0,attn_pdrop=0"
EVAL_TOKENS = 13 * 15  # 13 evaluation blocks of 16 tokens, 15 of them predicted


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """train.txt (300 generated lines, 4,249 words) and a word-level tokenizer trained on it."""
    pytest.importorskip("transformers", reason="the example needs transformers (in the test extra)")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("clm")
    rng = random.Random(0)
    nouns = ["cat", "dog", "bird", "fish", "horse", "cow", "sheep", "goat", "mouse", "lion"]
    verbs = ["sees", "chases", "eats", "likes", "finds", "follows", "hears", "greets"]
    adjectives = ["small", "big", "red", "blue", "old", "young", "quick", "lazy"]
    lines = []
    for _ in range(300):
        words: list[str] = []
        for _ in range(rng.randint(1, 3)):
            words += ["the", rng.choice(adjectives), rng.choice(nouns), rng.choice(verbs), "the"]
            words += [rng.choice(nouns), "."]
        lines.append(" ".join(words))
    (folder / "train.txt").write_text("\n".join(lines) + "\n")
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.train([str(folder / "train.txt")], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        eos_token="[EOS]",
        model_input_names=["input_ids", "attention_mask"],
    )
    assert len(fast) == 30
    fast.save_pretrained(folder / "tokenizer")
    return folder


def _args(corpus: Path, out: Path, *extra: str, dropout: bool = True) -> list[str]:
    return [
        "--train_file", str(corpus / "train.txt"),
        "--tokenizer_name", str(corpus / "tokenizer"),
        "--model_type", "gpt2",
        "--config_overrides", MODEL + ("" if dropout else NO_DROPOUT),
        "--block_size", "16",
        "--per_device_train_batch_size", "8",
        "--num_train_epochs", "2",
        "--learning_rate", "3e-3",
        "--num_warmup_steps", "3",
        "--weight_decay", "0.01",
        "--seed", "7",
        "--output_dir", str(out),
        *extra,
    ]  # fmt: skip


def _run(script: Path, args: list[str], *, torchrun: bool = False, ok: bool = True) -> str:
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun else []
    done = subprocess.run(
        [sys.executable, *launcher, str(script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=ENV,
        cwd=ROOT,
    )
    output = done.stdout + done.stderr
    assert (done.returncode == 0) == ok, output[-4000:]
    return output


def _weights(folder: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _bitwise_equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    import torch

    return a.keys() == b.keys() and all(
        torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)) for k in a
    )


def _records(run: Path) -> list[tuple[int, str, dict[str, float]]]:
    lines = (run / "clm_no_trainer" / "metrics.jsonl").read_text().splitlines()
    return [(r["step"], r["source"], r["metrics"]) for r in map(json.loads, lines)]


@pytest.fixture(scope="module")
def one_process(corpus: Path) -> tuple[Path, dict[str, Any]]:
    """The one-process run, in this process (dropout off, for the Accelerate comparison).

    ``main`` seeds the global generators (``--seed``); they are put back as they were after it.
    """
    import torch

    spec = importlib.util.spec_from_file_location("run_clm_example", SCRIPT)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    import numpy as np

    generators = torch.get_rng_state(), random.getstate(), np.random.get_state()
    torch.set_num_threads(1)  # as the autouse fixture, which a module fixture runs before
    out = corpus / "one-process"
    try:
        results = example.main(_args(corpus, out, dropout=False))
    finally:
        torch.set_rng_state(generators[0])
        random.setstate(generators[1])
        np.random.set_state(generators[2])
    return out, results


def test_one_process_trains_and_from_pretrained_loads_the_saved_folder(one_process: tuple[Path, Any]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, results = one_process
    assert results["step"] == 2 * 32  # 252 blocks in batches of 8: 32 steps an epoch
    assert results["eval_tokens"] == EVAL_TOKENS
    assert 1 < results["perplexity"] < 14  # 30 words: chance is 30; it learns the grammar
    assert json.loads((out / "all_results.json").read_text()) == {"perplexity": results["perplexity"]}
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    trained = results["model"].eval()
    ids = AutoTokenizer.from_pretrained(out)(["the small cat sees the dog ."], return_tensors="pt")[
        "input_ids"
    ]
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, trained(input_ids=ids).logits)


@example_run
def test_two_processes_killed_mid_epoch_resume_to_the_uninterrupted_weights(corpus: Path) -> None:
    # Dropout on, accumulation 2 (a partial last group: loss by token count), clipping, tracking:
    # the weights, AdamW, the schedule, every rank's generators, the data position and the
    # tracking sums all have to come back.
    extra = ("--gradient_accumulation_steps", "2", "--max_grad_norm", "1.0", "--with_tracking")
    straight, cut = corpus / "two-straight", corpus / "two-cut"
    out = _run(SCRIPT, _args(corpus, straight, *extra, "--checkpointing_steps", "epoch"), torchrun=True)
    done = json.loads(out.split("done: ", 1)[1].splitlines()[0])
    # 126 blocks a rank, 16 batches of 8 (the last of 6), 8 steps an epoch; every token evaluated once.
    assert (done["step"], done["eval_tokens"]) == (16, EVAL_TOKENS), out[-2000:]

    killed = _run(
        SCRIPT,
        _args(corpus, cut, *extra, "--checkpointing_steps", "4", "--kill_at_step", "12"),
        torchrun=True,
        ok=False,
    )
    assert "checkpointed step 12 (epoch 1, batch 8)" in killed
    assert "SIGKILL" in killed and not (cut / "model.safetensors").exists()
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == [
        "step-000000000008",
        "step-000000000012",
    ]

    resumed = _run(
        SCRIPT,
        _args(corpus, cut, *extra, "--resume_from_checkpoint", str(cut / "checkpoints")),
        torchrun=True,
    )
    assert "Resumed from checkpoint: step 12, epoch 1, batch 8" in resumed
    assert "epoch 0: perplexity" not in resumed  # the finished epoch is not trained again
    assert _bitwise_equal(_weights(cut), _weights(straight))
    assert (cut / "all_results.json").read_text() == (straight / "all_results.json").read_text()
    # Records 1-12 from the killed run, 13-16 from the resumed one: the same values as straight.
    assert _records(cut) == _records(straight)


def test_the_loop_under_accelerate_ends_with_the_same_weights(
    corpus: Path, one_process: tuple[Path, Any]
) -> None:
    pytest.importorskip("accelerate", reason="the comparison runs Accelerate (not in the test extra)")
    out = corpus / "accelerate"
    _run(ROOT / "tests" / "clm_accelerate.py", _args(corpus, out, dropout=False))
    # Seedable sampler: the same order (seed + epoch); every block 16 tokens and one micro-batch a
    # step, so a mean per batch is the mean per token. Bit for bit (dropout off: Accelerate's
    # loaders also draw from torch's global generator, one number per iterator; faccel's do not).
    assert _bitwise_equal(_weights(out), _weights(one_process[0]))
    theirs = json.loads((out / "all_results.json").read_text())
    assert theirs["step"] == one_process[1]["step"]
    # Its perplexity averages float32 batch means, faccel's float64 token sums: equal to ~1e-6.
    assert theirs["perplexity"] == pytest.approx(one_process[1]["perplexity"], rel=1e-5)
