"""The large-model path, 185M parameters on 2 gloo ranks: peak memory by phase, vs the whole model per rank.

The setting: a GPT-2 from a ``GPT2Config`` (no hub access; width 1024, 12
blocks, 16 heads, a vocabulary of 32000, 1024 positions, dropout off: about
185M parameters, 0.74 GB in float32), AdamW, FSDP2 over 2 gloo processes on the
CPU. The parent first builds the model normally (seed 0) and writes it with
``save_pretrained`` into a scratch folder, once. Then three subjects, each in its
own pair of fresh processes, one after the other:

* ``faccel``: the large-model path: (1) ``prepare``: build under
  ``torch.device("meta")``, AdamW over the meta parameters, and
  ``faccel.prepare(dist, model, optimizer, init="empty")`` (this rank's shards
  allocated, nothing else); (2) ``load_model``: ``faccel.load_model`` from the
  folder (each rank reads its rows); (3) ``step``: one training step (forward
  with labels on 2 sequences of 64 tokens, ``faccel.backward``, ``step``,
  ``zero_grad``); (4) ``checkpoint``: ``faccel.checkpoint`` (sharded: each rank
  writes its own shards); (5) ``save_model``: ``faccel.save_model`` (each rank
  gathers and writes its share);
* ``whole per rank``: the usual way, every rank holding the whole model first:
  (1) ``build + load``: the model built eagerly (whole, allocated and
  initialised on the CPU) and ``load_state_dict`` of the whole
  ``model.safetensors`` (``safetensors.torch.load_file``); (2) ``prepare``:
  AdamW and ``faccel.prepare(dist, model, optimizer)`` (FSDP2 shards it);
  then (3)-(5) as above;
* ``from_pretrained``: as ``whole per rank`` but (1) is
  ``GPT2LMHeadModel.from_pretrained(folder)`` on each rank, which in this
  transformers builds on meta and leaves the weights as views of the
  memory-mapped file: its pages are counted when first touched (by
  ``prepare``'s sharding copy), so the whole-model cost moves into ``prepare``.

Memory: each rank's resident set size (``/proc/self/statm``, which counts the
pages of a mapped file it touched too), sampled every 2 ms by a thread during
each phase; per phase, ``peak``: the peak minus the resident size just before
the phase, and ``held``: the size after it (garbage collected) minus the size
before it; as fractions of the whole model's bytes (parameters, float32). A
throwaway meta build runs before the first phase: the model code's first use
imports modules, which is code, not the model. The processes run with
``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the OS.
Time: wall clock from a barrier before the phase to one after it; indicative
only on a small shared machine. The criterion checked (faccel issue 22): no
rank's peak rises by more than 0.75x the whole model during ``prepare`` of the
meta model, ``load_model`` or ``save_model``. The step's loss is printed for
every subject: the same weights and batch give the same loss.

Accelerate's FSDP2 path with ``cpu_ram_efficient_loading`` is probed, not
measured: 2 gloo ranks make an ``Accelerator`` with a
``FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)``
and prepare a tiny GPT-2; the probe prints the distributed type Accelerate
chose and what the prepared model is (on the CPU it is not FSDP: see the line
printed). ``--accelerate-probe-only`` runs the probe alone.

    python benchmarks/bench_large_model.py                       # 185M parameters, 1 round
    python benchmarks/bench_large_model.py --width 128 --blocks 2 --heads 4 --vocab 1024  # a quick look
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Peak, gpt2_config, rank_env, rss_bytes, run_ranks

FACCEL, WHOLE, PRETRAINED = "faccel", "whole per rank", "from_pretrained"
SUBJECTS = (FACCEL, WHOLE, PRETRAINED)
PHASES = {
    FACCEL: ("prepare (meta)", "load_model", "step", "checkpoint", "save_model"),
    WHOLE: ("build + load", "prepare", "step", "checkpoint", "save_model"),
    PRETRAINED: ("from_pretrained", "prepare", "step", "checkpoint", "save_model"),
}
# The phases the criterion bounds, and the bound (x the whole model's bytes).
BOUNDED, BOUND = ("prepare (meta)", "load_model", "save_model"), 0.75
BATCH, TOKENS = 2, 64


def _config(payload: dict[str, Any]) -> Any:
    return gpt2_config(
        payload["width"],
        payload["blocks"],
        payload["vocab"],
        heads=payload["heads"],
        positions=payload["positions"],
    )


def _build(payload: dict[str, Any]) -> torch.nn.Module:
    import transformers

    return transformers.GPT2LMHeadModel(_config(payload))


def _phase(call: Callable[[], Any]) -> tuple[Any, list[float]]:
    """Run ``call`` between barriers; its result and [peak rise, held rise, seconds]."""
    torch.distributed.barrier()
    gc.collect()
    before = rss_bytes()
    with Peak() as peak:
        start = time.perf_counter()
        result = call()
        torch.distributed.barrier()
        seconds = time.perf_counter() - start
    gc.collect()
    return result, [float(peak.peak - before), float(rss_bytes() - before), seconds]


def _rank(rank: int, port: int, payload: dict[str, Any], out: str) -> None:
    os.environ.update(rank_env(rank, port))
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import attrs
    import transformers

    import faccel

    dist = faccel.detect(strategy="fsdp")
    folder, scratch = Path(payload["folder"]), Path(payload["scratch"])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, payload["vocab"], (BATCH, TOKENS), generator=generator)
    with torch.device("meta"):  # the model code's first use imports modules: not the model's memory
        _build(payload)
    figures: list[list[float]] = []
    box: dict[str, Any] = {}

    def meta_prepare() -> None:
        with torch.device("meta"):
            model = _build(payload)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        box["model"], box["optimizer"] = faccel.prepare(dist, model, optimizer, init="empty")

    def load() -> None:
        faccel.load_model(dist, box["model"], folder)

    def pretrained() -> None:
        box["model"] = transformers.GPT2LMHeadModel.from_pretrained(folder)

    def whole() -> None:
        from safetensors.torch import load_file

        model = _build(payload)  # eager: whole, allocated and initialised on the CPU
        model.load_state_dict(load_file(folder / "model.safetensors"), strict=False)  # the tied head
        box["model"] = model

    def whole_prepare() -> None:
        optimizer = torch.optim.AdamW(box["model"].parameters(), lr=1e-4)
        box["model"], box["optimizer"] = faccel.prepare(dist, box["model"], optimizer)

    def step() -> float:
        loss = box["model"](input_ids=ids, labels=ids).loss
        faccel.backward(dist, loss)
        box["optimizer"].step()
        box["optimizer"].zero_grad()
        return float(loss.detach())

    def save_checkpoint() -> None:
        state = faccel.TrainState.create(model=box["model"], optimizer=box["optimizer"])
        faccel.checkpoint(dist, attrs.evolve(state, step=1), scratch / "checkpoints", sharded=True)

    def export() -> None:
        faccel.save_model(dist, box["model"], scratch / "export")

    first = {
        FACCEL: (meta_prepare, load),
        WHOLE: (whole, whole_prepare),
        PRETRAINED: (pretrained, whole_prepare),
    }[payload["subject"]]
    loss = 0.0
    for call in (*first, step, save_checkpoint, export):
        result, got = _phase(call)
        figures.append(got)
        if call is step:
            loss = result
    local = torch.tensor([x for f in figures for x in f] + [loss], dtype=torch.float64)
    gathered = [torch.zeros_like(local) for _ in range(dist.world_size)]
    torch.distributed.all_gather(gathered, local)
    if rank == 0:
        count = len(figures)
        result_figures = {
            "phases": [[g[3 * i : 3 * i + 3].tolist() for g in gathered] for i in range(count)],
            "loss": float(gathered[0][3 * count]),
        }
        Path(out).write_text(json.dumps(result_figures))
    faccel.shutdown(dist)


def _accelerate_rank(rank: int, port: int, payload: dict[str, Any], out: str) -> None:
    os.environ.update(rank_env(rank, port))
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import FSDPModule

    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin)
    model = _build(payload)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    if rank == 0:
        found = {
            "distributed_type": str(accelerator.distributed_type),
            "is_fsdp2": bool(accelerator.is_fsdp2),
            "model": type(model).__name__,
            "fsdp": isinstance(model, FSDPModule),
            "sharded": any(type(p).__name__ == "DTensor" for p in model.parameters()),
        }
        Path(out).write_text(json.dumps(found))
    accelerator.end_training()


def accelerate_probe() -> str:
    """One line: what Accelerate does on 2 gloo ranks when asked for FSDP2 with cpu_ram_efficient_loading."""
    try:
        import accelerate
    except ImportError:
        return "Accelerate's FSDP2 path: not probed (accelerate is not installed)"
    tiny = {"width": 64, "blocks": 2, "heads": 4, "vocab": 256, "positions": 64}
    try:
        found: dict[str, Any] = run_ranks(_accelerate_rank, tiny, what="accelerate probe")  # type: ignore[assignment]
    except Exception as error:  # the probe reports, never fails the benchmark
        return f"Accelerate {accelerate.__version__} FSDP2 path on 2 gloo ranks: failed ({error})"
    if found["fsdp"] or found["sharded"]:
        verdict = "sharded by FSDP2: measurable"
    else:
        verdict = (
            "NOT sharded: on the CPU Accelerate keeps its MULTI_CPU type and ignores the FSDP plugin "
            "(accelerate/state.py sets FSDP only for GPU-like types), so there is no FSDP2 path to measure"
        )
    return (
        f"Accelerate {accelerate.__version__}, FullyShardedDataParallelPlugin(fsdp_version=2, "
        f"cpu_ram_efficient_loading=True), Accelerator(cpu=True) on 2 gloo ranks: distributed type "
        f"{found['distributed_type']}, is_fsdp2 {found['is_fsdp2']}, prepared model {found['model']}; "
        f"{verdict}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--scratch", default=None, help="folder for the files (default: a temporary one)")
    parser.add_argument("--accelerate-probe-only", action="store_true", help="only the Accelerate probe")
    args = parser.parse_args(argv)
    if args.accelerate_probe_only:
        print(accelerate_probe(), flush=True)
        return 0
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    payload: dict[str, Any] = {
        "width": args.width,
        "blocks": args.blocks,
        "heads": args.heads,
        "vocab": args.vocab,
        "positions": args.positions,
    }
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="faccel-bench-"))
    got: dict[str, dict[str, Any]] = {}
    try:
        folder = scratch / "start"
        torch.manual_seed(0)
        model = _build(payload)
        parameters = sum(p.numel() for p in model.parameters())  # the tied head counted once
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        gc.collect()
        for subject in SUBJECTS:
            work = scratch / subject.replace(" ", "-")
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            run = {**payload, "subject": subject, "folder": str(folder), "scratch": str(work)}
            got[subject] = run_ranks(_rank, run, what=subject)  # type: ignore[assignment]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(
        f"model: GPT-2, width {args.width}, {args.blocks} blocks, vocabulary {args.vocab}: "
        f"{parameters / 1e6:.1f}M parameters, {model_bytes / 1e9:.3f} GB in float32; AdamW; "
        f"FSDP2 on 2 gloo ranks"
    )
    print("peak / held: resident-size rise during / after the phase, x the whole model's bytes")
    print("subject         phase             peak r0  peak r1  held r0  held r1   seconds")
    verdicts = []
    for subject in SUBJECTS:
        for name, ranks in zip(PHASES[subject], got[subject]["phases"], strict=True):
            peak = [r[0] / model_bytes for r in ranks]
            held = [r[1] / model_bytes for r in ranks]
            seconds = max(r[2] for r in ranks)
            print(
                f"{subject:<15} {name:<16} {peak[0]:8.2f} {peak[1]:8.2f} {held[0]:8.2f} {held[1]:8.2f}"
                f" {seconds:9.1f}"
            )
            if subject == FACCEL and name in BOUNDED:
                verdicts.append((name, max(peak)))
    print("loss of the step: " + ", ".join(f"{subject} {got[subject]['loss']:.6f}" for subject in SUBJECTS))
    print("times: wall clock on a small shared machine, indicative only")
    met = all(peak <= BOUND for _, peak in verdicts)
    detail = ", ".join(f"{name} {peak:.2f}x" for name, peak in verdicts)
    print(
        f"criterion (no rank's peak over {BOUND}x the model in {', '.join(BOUNDED)}): "
        f"{'met' if met else 'NOT met'} ({detail})"
    )
    print(accelerate_probe(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
