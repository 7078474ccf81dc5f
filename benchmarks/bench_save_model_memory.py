"""save_model of an FSDP2 model on 2 gloo ranks: extra memory a rank, its own share vs the whole gather.

The setting: a GPT-2 built from a ``GPT2Config`` (no hub access; width 768, 8
blocks, a vocabulary of 8192: about 63M parameters, 0.25 GB in float32, the
largest tensor the 25 MB embedding), sharded by ``faccel.prepare`` (FSDP2). Subjects, each
in its own pair of fresh processes, alternating:

* ``faccel``: ``faccel.save_model`` as it is: every rank walks the tensors in
  one order, gathers each whole (``full_tensor()``), keeps only those the plan
  gives it (balanced by bytes) and streams them into its own shard files;
  rank 0 writes the index and ``config.json``;
* ``whole gather``: what ``save_model`` did before, reproduced here: the
  whole model gathered onto rank 0 (``get_model_state_dict`` with
  ``full_state_dict=True, cpu_offload=True``), which writes every file.

Memory: each rank's resident set size (``/proc/self/statm``), sampled every
2 ms by a thread during the call; the figure is the peak minus the resident
size just before the call ("extra"), as a fraction of the model's bytes; the
larger of the two ranks'. The processes run with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the OS for
both subjects alike. Time: wall clock from a barrier before the call to one
after it. The tensors faccel writes are checked bitwise equal to the whole
gather's (which also stores the tied ``lm_head.weight`` a second time: the
gathered state dict loses the tie).

    python benchmarks/bench_save_model_memory.py               # 63M parameters, 3 rounds
    python benchmarks/bench_save_model_memory.py --width 512 --rounds 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Peak, gpt2_config, rank_env, rss_bytes, run_ranks

FACCEL, WHOLE = "faccel", "whole gather"


def _model(width: int, blocks: int, vocab: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(gpt2_config(width, blocks, vocab, dropout=None))


def _whole_gather_save(dist: Any, model: torch.nn.Module, folder: Path) -> None:
    """save_model before each rank wrote its share: everything gathered onto rank 0, which writes."""
    from faccel._checkpoint._strategies._fsdp import full_state
    from faccel._hf._naming import parse_size
    from faccel._hf._save_model import _configs, _write_model
    from faccel._storage._roots import spot_of
    from faccel._storage._weights import model_tensors

    whole = full_state(model, None)[0]
    if dist.is_main_process:
        stored, _ = model_tensors(model, whole)
        configs = {name: text.encode() for name, text in _configs(model).items()}
        _write_model(spot_of(folder), stored, parse_size("5GB"), configs)
    torch.distributed.barrier()


def _rank(rank: int, port: int, payload: dict[str, Any], out: str) -> None:
    os.environ.update(rank_env(rank, port))
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import faccel

    dist = faccel.detect(strategy="fsdp")
    model = faccel.prepare(dist, _model(payload["width"], payload["blocks"], payload["vocab"]))
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    folder = Path(payload["folder"])
    if payload["subject"] == FACCEL:
        call = lambda: faccel.save_model(dist, model, folder)  # noqa: E731
    else:
        call = lambda: _whole_gather_save(dist, model, folder)  # noqa: E731
    torch.distributed.barrier()
    gc.collect()
    before = rss_bytes()
    with Peak() as peak:
        start = time.perf_counter()
        call()
        torch.distributed.barrier()
        seconds = time.perf_counter() - start
    extra = torch.tensor([peak.peak - before, seconds], dtype=torch.float64)
    gathered = [torch.zeros_like(extra) for _ in range(dist.world_size)]
    torch.distributed.all_gather(gathered, extra)
    if rank == 0:
        figures = {
            "model_bytes": model_bytes,
            "largest": largest,
            "extra": [int(g[0]) for g in gathered],
            "seconds": max(float(g[1]) for g in gathered),
        }
        Path(out).write_text(json.dumps(figures))


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def measure(subject: str, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    folder = scratch / subject.replace(" ", "-")
    shutil.rmtree(folder, ignore_errors=True)
    payload = {
        "subject": subject,
        "folder": str(folder),
        "width": args.width,
        "blocks": args.blocks,
        "vocab": args.vocab,
    }
    return run_ranks(_rank, payload, what=subject)  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--rounds", type=int, default=3, help="the figures are medians over the rounds")
    parser.add_argument("--scratch", default=None, help="folder for the saves (default: a temporary one)")
    args = parser.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="faccel-bench-"))
    got: dict[str, list[dict[str, Any]]] = {FACCEL: [], WHOLE: []}
    try:
        for round_ in range(args.rounds):
            for subject in [FACCEL, WHOLE] if round_ % 2 == 0 else [WHOLE, FACCEL]:
                got[subject].append(measure(subject, args, scratch))
        mine, theirs = _tensors(scratch / FACCEL), _tensors(scratch / WHOLE.replace(" ", "-"))
        same = all(torch.equal(mine[k], theirs[k]) for k in mine) and set(mine) <= set(theirs)
        extra_names = sorted(set(theirs) - set(mine))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    model_bytes, largest = got[FACCEL][0]["model_bytes"], got[FACCEL][0]["largest"]
    print(
        f"model: {model_bytes / 4e6:.1f}M parameters, {model_bytes / 1e9:.3f} GB; largest tensor "
        f"{largest / 1e6:.1f} MB; faccel's tensors bitwise equal to the whole gather's: {same}"
    )
    if extra_names:  # the gathered state dict loses the tie: the head is stored a second time
        print(f"stored by the whole gather only (a tied weight stored twice): {extra_names}")
    print("subject        extra rank 0  extra rank 1   (x model bytes)   seconds   (medians)")
    ratios = {}
    for subject in (FACCEL, WHOLE):
        per_rank = [statistics.median(r["extra"][k] for r in got[subject]) / model_bytes for k in (0, 1)]
        seconds = statistics.median(r["seconds"] for r in got[subject])
        ratios[subject] = max(per_rank)
        print(f"{subject:<13} {per_rank[0]:13.2f} {per_rank[1]:13.2f} {'':17} {seconds:9.2f}")
    print(
        f"largest rank's extra memory, faccel / whole gather: {ratios[FACCEL] / ratios[WHOLE]:.2f}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
