"""Activation checkpointing: the memory a step keeps for its backward, and its time, vs plain PyTorch.

The setting: a small GPT (token embedding, ``DEPTH`` pre-norm blocks of causal
self-attention and a 4x MLP with GELU and dropout, a final norm and a head),
width 256, 4 heads, batch 8 x 256 tokens, float32 on the CPU, one thread.
Subjects:

* ``plain PyTorch``: the model as it is;
* ``by hand``: the same model with each block called through
  ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)`` in its forward;
* ``faccel``: the plain model through ``faccel.prepare(dist, model,
  activation_checkpointing=Block)``.

Figures:

* *activations kept*: the bytes the step holds between its forward and its
  backward, beside the parameters: every distinct storage autograd saved
  (counted with ``torch.autograd.graph.saved_tensors_hooks``, parameters left
  out), plus the inputs a checkpointed block keeps to run its forward again
  (counted with a forward pre-hook on each block). Deterministic: one count.
* *peak RSS*: each subject in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536``,
  so freed tensors go back to the OS): the process's peak resident set
  (``VmHWM``, reset just before) over one forward and backward, minus its resident set just
  before it (the model, the optimizer state and the interpreter). Medians of
  the rounds.
* *time*: a forward and backward, interleaved rounds (``benchmarks/common.py``);
  the recomputed forwards are the price.

    python benchmarks/bench_activation_checkpointing.py              # 5 rounds
    python benchmarks/bench_activation_checkpointing.py --rounds 3
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # `python benchmarks/bench_...py` puts only this folder on the path
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402 (after the path fix above)
from torch import nn  # noqa: E402

from benchmarks.common import FACCEL, PLAIN, interleave, per_call, rss_bytes  # noqa: E402

BY_HAND = "by hand"
SUBJECTS = (PLAIN, BY_HAND, FACCEL)
WIDTH, HEADS, DEPTH, VOCAB, BATCH, TOKENS = 256, 4, 6, 512, 8, 256


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x MLP, each with dropout."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, c // self.heads).unbind(2)
        att = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.drop(self.out(att.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm2(x)))))


class GPT(nn.Module):
    def __init__(self, *, by_hand: bool = False) -> None:
        super().__init__()
        self.by_hand = by_hand
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(WIDTH, HEADS) for _ in range(DEPTH))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) if self.by_hand else block(x)
        return self.head(self.norm(x))


def build(subject: str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model: nn.Module = GPT(by_hand=subject == BY_HAND)
    if subject == FACCEL:
        import faccel

        model = faccel.prepare(faccel.detect({}), model, activation_checkpointing=Block)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)
    targets = torch.randint(0, VOCAB, (BATCH, TOKENS), generator=g)
    return model, tokens, targets


def _loss(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def activations_kept(subject: str) -> int:
    """Bytes of the distinct non-parameter storages one forward leaves for its backward."""
    model, tokens, targets = build(subject)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        keep(tensor)
        return tensor

    def inputs(module: nn.Module, args: tuple[Any, ...]) -> None:
        if subject != PLAIN and torch.is_grad_enabled():  # what a checkpointed block holds to rerun
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    keep(arg)

    hooks = [block.register_forward_pre_hook(inputs) for block in model.blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = _loss(model, tokens, targets)
    loss.backward()
    for hook in hooks:
        hook.remove()
    return sum(kept.values())


def _peak_rss() -> int:
    """The process's peak resident set since the last :func:`_reset_peak` (VmHWM)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS to the current RSS (Linux)
        f.write("5")


def peak_rss_of_a_step(subject: str) -> int:
    """In this (fresh) process: peak RSS over one forward and backward, minus the RSS just before it."""
    torch.set_num_threads(1)
    model, tokens, targets = build(subject)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):  # warm: the allocator, the gradients, the dispatcher's caches
        optimizer.zero_grad(set_to_none=False)
        _loss(model, tokens, targets).backward()
    optimizer.zero_grad(set_to_none=False)
    # The peak of this step only: the import and the model's build may peak higher, earlier.
    _reset_peak()
    before = rss_bytes()
    _loss(model, tokens, targets).backward()
    return _peak_rss() - before


def _peak_in_fresh_process(subject: str) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, __file__, "--peak", subject], capture_output=True, text=True, env=env, check=True
    )
    return int(json.loads(done.stdout.strip().splitlines()[-1]))


def _time_block(subject: str, steps: int) -> Any:
    model, tokens, targets = build(subject)

    def block() -> None:
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            _loss(model, tokens, targets).backward()

    return functools.partial(per_call, block, 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="the RSS and time figures are medians")
    parser.add_argument("--peak", choices=SUBJECTS, help=argparse.SUPPRESS)  # one measurement, in a child
    args = parser.parse_args(argv)
    if args.peak:
        print(json.dumps(peak_rss_of_a_step(args.peak)))
        return 0
    torch.set_num_threads(1)
    mb = 1 / 2**20
    print(
        f"GPT, width {WIDTH}, {DEPTH} blocks, {HEADS} heads, batch {BATCH} x {TOKENS} tokens, "
        f"float32, CPU, 1 thread; {args.rounds} rounds"
    )
    kept = {subject: activations_kept(subject) for subject in SUBJECTS}
    peaks: dict[str, list[int]] = {subject: [] for subject in SUBJECTS}
    for round_ in range(args.rounds):
        shift = round_ % len(SUBJECTS)
        for subject in SUBJECTS[shift:] + SUBJECTS[:shift]:
            peaks[subject].append(_peak_in_fresh_process(subject))
    times = interleave({s: _time_block(s, 2) for s in SUBJECTS}, rounds=args.rounds)
    print(f"{'subject':>14}  activations kept MB  ratio  peak RSS of a step MB  ratio  s/step  ratio")
    for subject in SUBJECTS:
        peak, seconds = statistics.median(peaks[subject]), statistics.median(times[subject]) / 2
        base_peak, base_seconds = statistics.median(peaks[PLAIN]), statistics.median(times[PLAIN]) / 2
        print(
            f"{subject:>14}  {kept[subject] * mb:19.1f}  {kept[subject] / kept[PLAIN]:5.3f}  "
            f"{peak * mb:21.1f}  {peak / base_peak:5.3f}  {seconds:6.3f}  {seconds / base_seconds:5.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
