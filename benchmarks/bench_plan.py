"""The memory plan against measured memory: FSDP2 on 2 gloo ranks, a GPT-2 built on meta, two AdamW steps.

The setting: a GPT-2 built from a ``GPT2Config`` (no hub access; width 768, 8
blocks, a vocabulary of 8192, 256 positions, dropout off: about 63M parameters,
0.25 GB in float32) under ``torch.device("meta")``, sharded and allocated by
``faccel.prepare(dist, model, init=fill)`` (FSDP2 over the 2 ranks; ``fill``
draws each module's own tensors, as ``init="reset"`` would for a model with
``reset_parameters``), then ``torch.optim.AdamW`` and two training steps on a
batch of 4 sequences of 128 tokens (``zero_grad``, forward with labels, backward,
step): the second is the steady one, with AdamW's state already made.

Memory: each rank's resident set size (``/proc/self/statm``), sampled every
2 ms by a thread from just before the meta build to just after the second step;
the figures are the growth over the resident size before the build: the peak,
and the size after the second step (garbage collected). A throwaway meta build
runs before that baseline: the model code's first use imports modules (about
140 MB here), which is code, not the model. The processes run with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the OS.

The plan: ``faccel.estimate_memory(build, 2, ["fsdp"], optimizer="adamw",
inputs=the batch)``, made in the parent on fake tensors before the ranks start.
Its ``states`` (parameters, gradients, AdamW state, buffers) is compared with
the growth after the second step; its ``peak`` (the states and what is in
flight, with the larger of activations and gradients) and its ``total``
(everything added up) with the peak. The figure is measured / plan, the larger
rank's. Plan in MB here (1e6 bytes); ``python -m faccel plan`` prints MiB or GiB.

    python benchmarks/bench_plan.py                 # 63M parameters, 3 rounds
    python benchmarks/bench_plan.py --width 512 --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Peak, gpt2_config, rank_env, rss_bytes, run_ranks

BATCH, TOKENS = 4, 128


def _config(width: int, blocks: int, vocab: int) -> Any:
    return gpt2_config(width, blocks, vocab)


def _build(payload: dict[str, Any]) -> torch.nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(_config(payload["width"], payload["blocks"], payload["vocab"]))


def _fill(module: torch.nn.Module) -> None:
    """Each module's own tensors drawn (what init='reset' does for a model with reset_parameters)."""
    with torch.no_grad():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.is_floating_point():
                tensor.normal_(0.0, 0.02)


def _batch(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, TOKENS), generator=torch.Generator().manual_seed(0))


def _rank(rank: int, port: int, payload: dict[str, Any], out: str) -> None:
    os.environ.update(rank_env(rank, port))
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import transformers  # noqa: F401 - imported before the baseline, as the model code is

    import faccel

    dist = faccel.detect(strategy="fsdp")
    ids = _batch(payload["vocab"])
    with torch.device("meta"):  # the model code's first use imports modules (140 MB): not the model's memory
        _build(payload)
    torch.distributed.barrier()
    gc.collect()
    before = rss_bytes()
    with Peak() as peak:
        torch.manual_seed(0)
        with torch.device("meta"):
            model = _build(payload)
        model = faccel.prepare(dist, model, init=_fill)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for _ in range(2):  # the second step is the steady one: AdamW's state exists during its forward
            optimizer.zero_grad()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            del loss
            optimizer.step()
        gc.collect()
        after = rss_bytes()
    figures = torch.tensor([peak.peak - before, after - before], dtype=torch.float64)
    gathered = [torch.zeros_like(figures) for _ in range(dist.world_size)]
    torch.distributed.all_gather(gathered, figures)
    if rank == 0:
        Path(out).write_text(
            json.dumps({"peak": [int(g[0]) for g in gathered], "after": [int(g[1]) for g in gathered]})
        )
    faccel.shutdown(dist)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3, help="the figures are medians over the rounds")
    args = parser.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    import faccel

    payload = {"width": args.width, "blocks": args.blocks, "vocab": args.vocab}
    ids = _batch(args.vocab)
    plan = faccel.estimate_memory(
        lambda: _build(payload), 2, ["fsdp"], inputs={"input_ids": ids, "labels": ids}
    )
    row = plan.layouts[0]
    print(plan)
    got = [run_ranks(_rank, payload, what="FSDP2 step") for _ in range(args.rounds)]
    peak = [statistics.median(r["peak"][k] for r in got) for k in (0, 1)]  # type: ignore[index]
    after = [statistics.median(r["after"][k] for r in got) for k in (0, 1)]  # type: ignore[index]
    mb = 1e6
    print(
        f"\n{plan.parameters / 1e6:.1f}M parameters, 2 ranks, FSDP2, AdamW, batch {BATCH}x{TOKENS}; "
        f"{args.rounds} rounds (medians)"
    )
    print(f"{'figure':<40} {'plan (MB)':>9} {'rank 0 (MB)':>13} {'rank 1 (MB)':>13}  measured / plan")
    for name, planned, measured in (
        ("states after the step", row.states, after),
        ("peak", row.peak, peak),
        ("sum (states + in flight + activations)", row.total, peak),
    ):
        print(
            f"{name:<40} {planned / mb:9.1f} {measured[0] / mb:13.1f} {measured[1] / mb:13.1f} "
            f"{max(measured) / planned:10.2f}"
        )
    print(
        f"plan parts (MB): parameters {row.parameters / mb:.1f}, gradients {row.gradients / mb:.1f}, AdamW "
        f"{row.optimizer / mb:.1f}, buffers {row.buffers / mb:.1f}, in flight {row.in_flight / mb:.1f}, "
        f"activations {(row.activations or 0) / mb:.1f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
