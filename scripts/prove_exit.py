"""The long proof that two-process jobs exit: 50 or more torchrun runs, every one must end.

    PYTHONPATH=. python scripts/prove_exit.py [runs] [--twin | --collective]   # default: 50 of run_clm.py

1 of 12 two-process runs of examples/run_clm.py never exited on rank 1 (after
``faccel.shutdown``, freeing the DDP wrapper waited on a gloo worker thread that waited for
the interpreter lock). Each run here is a whole ``torchrun --nproc-per-node 2`` job of
run_clm (one epoch of the tests' small GPT-2 on a generated corpus, evaluation, save_model,
shutdown), or with ``--twin`` of tests/distributed/scripts/exit_twin.py, its life cycle
without transformers. A job that outlives four times the first job's duration plus a minute
counts as hung: the native stacks of its processes (gdb) are printed and it is killed. The
suite runs the same loop (tests/distributed/test_exit.py) with three twin jobs.

``--collective`` runs tests/distributed/scripts/exit_after_collective.py instead: an FSDP2 job
whose last act is an ``all_gather`` of tensors it drops at once (every other run then calls
``shutdown``); each must exit with status 0, not abort as gloo's worker frees them.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

from tests.distributed import test_exit

ROOT = Path(__file__).resolve().parents[1]
MODEL = "n_layer=2,n_embd=32,n_head=2,n_positions=64,vocab_size=30,bos_token_id=1,eos_token_id=1"


def corpus(folder: Path) -> Path:
    """train.txt (300 generated lines) and a word-level tokenizer of 30 words, as the run_clm tests make."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    fast.save_pretrained(folder / "tokenizer")
    return folder


def run_clm_command(data: Path, out: Path) -> list[str]:
    """One epoch of run_clm on two processes, with evaluation and save_model, into ``out``."""
    return [
        *test_exit.TORCHRUN, str(ROOT / "examples" / "run_clm.py"),
        "--train_file", str(data / "train.txt"),
        "--tokenizer_name", str(data / "tokenizer"),
        "--model_type", "gpt2",
        "--config_overrides", MODEL,
        "--block_size", "16",
        "--per_device_train_batch_size", "8",
        "--num_train_epochs", "1",
        "--learning_rate", "3e-3",
        "--seed", "7",
        "--output_dir", str(out),
    ]  # fmt: skip


def main(runs: int, twin: bool, collective: bool = False) -> int:
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if collective:
            outcomes = test_exit.exit_loop(runs, test_exit.collective_command)
            what = "exit_after_collective.py"
        elif twin:
            outcomes = test_exit.exit_loop(runs)
            what = "exit_twin.py"
        else:
            data = corpus(Path(tmp))
            outcomes = test_exit.exit_loop(runs, lambda out: run_clm_command(data, out))
            what = "examples/run_clm.py"
    hung = [o for o in outcomes if not o.exited]
    failed = [o for o in outcomes if o.exited and o.returncode != 0]
    for outcome in hung:
        print(f"HUNG after {outcome.seconds:.0f} s; its stacks:\n{outcome.stacks}")
    seconds = sorted(o.seconds for o in outcomes if o.exited)
    median = seconds[len(seconds) // 2] if seconds else float("nan")
    print(
        f"{what}: {runs} two-process runs, {len(hung)} hung, {len(failed)} failed "
        f"(exit codes {[o.returncode for o in failed]}), median {median:.1f} s a run, "
        f"{time.perf_counter() - start:.0f} s in all"
    )
    return 1 if hung or failed else 0


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a not in ("--twin", "--collective")]
    runs = int(arguments[0]) if arguments else 50
    sys.exit(main(runs, "--twin" in sys.argv[1:], "--collective" in sys.argv[1:]))
