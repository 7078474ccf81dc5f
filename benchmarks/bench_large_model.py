"""The large-model path, 515M parameters, 4 gloo ranks: memory by phase vs Accelerate FSDP2, whole per rank.

The setting: a GPT-2 from a ``GPT2Config`` (no hub access; by default width
1280, 24 blocks, 20 heads, a vocabulary of 32000, 1024 positions, dropout off:
about 515M parameters, 2.06 GB in float32; the model printed first is the one
measured), AdamW, FSDP2 over ``--world`` gloo processes (default 4) on the CPU.
The parent first builds the model normally (seed 0) and writes it with
``save_pretrained`` into a scratch folder, once. Then the subjects, each in its
own set of fresh processes, one after the other (``--subjects`` chooses them):

* ``faccel``: the large-model path: (1) ``prepare (meta)``: build under
  ``torch.device("meta")``, AdamW over the meta parameters, and
  ``faccel.prepare(dist, model, optimizer, init="empty")`` (this rank's shards
  allocated, nothing else); (2) ``load_model``: ``faccel.load_model`` from the
  folder (each rank reads its rows); (3) ``step``: one training step (forward
  with labels on 2 sequences of 64 tokens, ``faccel.backward``, ``step``,
  ``zero_grad``); (4) ``checkpoint``: ``faccel.checkpoint`` (sharded: each rank
  writes its own shards); (5) ``save_model``: ``faccel.save_model`` (each rank
  gathers and writes its share);
* ``Accelerate FSDP2``: Accelerate's own large-model path, FSDP2 with
  ``cpu_ram_efficient_loading``, in the environment ``accelerate launch`` sets
  for it (``ACCELERATE_USE_FSDP=true``, ``FSDP_CPU_RAM_EFFICIENT_LOADING=true``):
  (1) ``from_pretrained``: ``GPT2LMHeadModel.from_pretrained(folder)``; the
  transformers measured (5.24) still gives every rank real parameters in this
  environment (its rank-0-only handling covers missing keys and buffers, not
  the loaded weights), views of the memory-mapped file whose pages are not
  read yet: the line "parameters not on meta" shows it per rank;
  (2) ``prepare``: AdamW and ``accelerator.prepare(model, optimizer)``
  (the model moved to meta and sharded by ``fully_shard``, per ``GPT2Block``
  and for the rest, then rank 0's full weights broadcast tensor by tensor,
  each rank keeping its shard); (3) ``step``: the same step, with ``accelerator.backward``;
  (4) ``checkpoint``: ``accelerator.save_state(folder)`` (torch.distributed
  checkpoint, each rank its own files, and a pickled RNG state per rank);
  (5) ``save_model``: ``accelerator.save_model(model, folder)`` (the full state
  dict gathered to rank 0, which writes it; the tied head is written as a
  second tensor, hence its export is larger than the model: "wrote" lines);
* ``whole per rank``: the usual way, every rank holding the whole model first:
  (1) ``build + load``: the model built eagerly (whole, allocated and
  initialised on the CPU) and ``load_state_dict`` of the whole
  ``model.safetensors`` (``safetensors.torch.load_file``); (2) ``prepare``:
  AdamW and ``faccel.prepare(dist, model, optimizer)`` (FSDP2 shards it);
  then (3)-(5) as for faccel. Each rank holds about twice the model in (1), so
  before it starts the parent estimates ``world x (2 x the model's bytes + its
  own resident size, as an interpreter's)`` and skips the subject, saying so,
  when that is over 80% of ``MemAvailable`` (``/proc/meminfo``);
* ``from_pretrained`` (not run by default): as ``whole per rank`` but (1) is
  ``GPT2LMHeadModel.from_pretrained(folder)`` on each rank, which in this
  transformers builds on meta and leaves the weights as views of the
  memory-mapped file: its pages are counted when first touched (by
  ``prepare``'s sharding copy), so the whole-model cost moves into ``prepare``,
  counted once per rank though the pages are the page cache's, shared. The
  Accelerate subject starts with the same call, and this subject would add
  a fourth run of the model's size: it is left out unless asked for.

Accelerate on the CPU had to be forced onto its FSDP path. Accelerate 1.15's
``Accelerator(cpu=True, fsdp_plugin=...)`` keeps the distributed type
``MULTI_CPU`` and ignores the plugin (``accelerate/state.py`` sets ``FSDP`` only
for GPU-like device types), so ``prepare`` would make a
``DistributedDataParallel`` of the whole model (the probe printed last shows
it). Each rank therefore sets the two environment variables above, makes
``FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True,
auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])``
and ``Accelerator(cpu=True, fsdp_plugin=plugin)``, then sets by hand
``accelerator.state.fsdp_plugin = plugin``,
``accelerator.state.distributed_type = DistributedType.FSDP`` and the same type
in ``PartialState._shared_state`` (what ``AcceleratorState.__init__`` does
itself when it picks FSDP on GPUs). The third is needed: without it the
``AcceleratorState()`` that ``AcceleratedOptimizer`` makes inside ``prepare``
copies ``MULTI_CPU`` back, ``is_fsdp2`` turns False halfway through
``prepare``, and ``backward``, ``save_state`` and ``save_model`` take their
non-FSDP branches: then ``save_state`` and ``save_model`` raise "Attempted to
access the data pointer on an invalid python storage" (the non-FSDP
``state_dict`` of DTensors); fully forced, both ran in the runs made while
writing this. From there on the code run is Accelerate's own
(``fsdp2_prepare_model``, ``fsdp2_load_full_state_dict``, ``save_state``,
``save_model``), in a configuration Accelerate does not set up itself on the
CPU. ``prepare`` fails (reported) if the model did not come out of it as FSDP2.
A phase that raises, in any subject, is reported with its error text in place
of its figures and the benchmark goes on; a subject whose processes fail or
pass ``--timeout`` is reported as failed (no workaround outside Accelerate is
used).

Memory: each rank's resident set size (``/proc/self/statm``, which counts the
pages of a mapped file it touched too), sampled every 2 ms by a thread during
each phase; per phase and rank, ``peak``: the absolute peak in GB; ``rise``: the
peak minus the resident size just before the phase; ``held``: the size after
it (garbage collected) minus the size before it; rise and held as fractions of
the whole model's bytes (parameters, float32). A throwaway meta build runs
before the first phase: the model code's first use imports modules, which is
code, not the model. The baseline printed is each rank's resident size just
before the first phase (after the imports, the process group and that meta
build): what the interpreter takes before any of the model. The processes run
with ``MALLOC_MMAP_THRESHOLD_=65536`` so that freed tensors go back to the OS.
Time: wall clock from a barrier before the phase to one after it; indicative
only on a small shared machine; faccel's load (``prepare (meta)`` +
``load_model``) and export (``save_model``) and checkpoint times are printed
as ratios to Accelerate's (``from_pretrained`` + ``prepare``; ``save_model``;
``save_state``), or the reason there is none.

Checked: (1) the large-model memory criterion: no rank's peak rises by more
than 0.75x the whole model during ``prepare`` of the meta model,
``load_model`` or ``save_model``; (2) the large-model target: in every faccel
phase, every rank's absolute peak resident size is at most 1.15x its share of
parameters, gradients and AdamW's two states (16 bytes a parameter / world)
plus 300 MB. The step's loss is printed for every subject: the same weights
and batch give the same loss.

    python benchmarks/bench_large_model.py       # 515M parameters, 4 ranks (about 18 GB at the peak)
    python benchmarks/bench_large_model.py --world 2 --width 1024 --blocks 12 --heads 16  # 185M, 2 ranks
    python benchmarks/bench_large_model.py --width 128 --blocks 2 --heads 4 --vocab 1024  # a quick look
    python benchmarks/bench_large_model.py --subjects faccel,accelerate,whole,pretrained  # all four
    python benchmarks/bench_large_model.py --accelerate-probe-only  # what Accelerate does unforced
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
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Peak, gpt2_config, rank_env, rss_bytes, run_ranks

FACCEL, ACCELERATE, WHOLE, PRETRAINED = "faccel", "Accelerate FSDP2", "whole per rank", "from_pretrained"
# Command-line key -> subject, in the order they run.
KEYS = {"faccel": FACCEL, "accelerate": ACCELERATE, "whole": WHOLE, "pretrained": PRETRAINED}
DEFAULT_SUBJECTS = "faccel,accelerate,whole"
PHASES = {
    FACCEL: ("prepare (meta)", "load_model", "step", "checkpoint", "save_model"),
    ACCELERATE: ("from_pretrained", "prepare", "step", "checkpoint", "save_model"),
    WHOLE: ("build + load", "prepare", "step", "checkpoint", "save_model"),
    PRETRAINED: ("from_pretrained", "prepare", "step", "checkpoint", "save_model"),
}
# The phases the memory criterion bounds, and the bound (x the whole model's bytes).
BOUNDED, BOUND = ("prepare (meta)", "load_model", "save_model"), 0.75
# The large-model target: per-rank peak <= SLACK x (BYTES_PER_PARAMETER x parameters / world) + FLOOR.
SLACK, BYTES_PER_PARAMETER, FLOOR = 1.15, 16, 300e6
# The whole-per-rank subject runs only when its estimate is within this share of MemAvailable.
MEMORY_SHARE = 0.8
BATCH, TOKENS = 2, 64
GB = 1e9


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


def _error_text(error: BaseException) -> str:
    """An exception in one line of at most 300 characters."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= 300 else text[:297] + "..."


def _real_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters not on the meta device (the tied head counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type != "meta")


def _phase(call: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """Run ``call`` between barriers; its result and this rank's figures (bytes, seconds, error or None).

    An exception in ``call`` is caught and its text kept: a library's phase that fails is a result
    of the benchmark, not the end of it.
    """
    torch.distributed.barrier()
    gc.collect()
    before = rss_bytes()
    result, error = None, None
    with Peak() as peak:
        start = time.perf_counter()
        try:
            result = call()
        except Exception as caught:
            error = _error_text(caught)
        torch.distributed.barrier()
        seconds = time.perf_counter() - start
    gc.collect()
    figures = {"before": before, "peak": peak.peak, "after": rss_bytes(), "seconds": seconds, "error": error}
    return result, figures


def _measure(rank: int, payload: dict[str, Any], out: str, calls: tuple[Callable[[], Any], ...]) -> None:
    """Run the phases ``calls`` (the third is the step); rank 0 writes every rank's figures to ``out``.

    Each rank writes its figures as JSON into the subject's scratch folder; after a barrier rank 0
    gathers them (files, not pickled objects).
    """
    with torch.device("meta"):  # the model code's first use imports modules: not the model's memory
        _build(payload)
    gc.collect()
    baseline = rss_bytes()
    phases = []
    for call in calls:
        result, figures = _phase(call)
        figures["result"] = result if isinstance(result, (int, float)) else None
        phases.append(figures)
    scratch = Path(payload["scratch"])
    mine = {"baseline": baseline, "phases": phases}
    (scratch / f"rank{rank}.json").write_text(json.dumps(mine))
    torch.distributed.barrier()
    if rank == 0:
        ranks = [json.loads((scratch / f"rank{r}.json").read_text()) for r in range(payload["world"])]
        written = {}
        for what in ("checkpoints", "export"):
            files = [f for f in (scratch / what).rglob("*") if f.is_file()]
            written[what] = [len(files), sum(f.stat().st_size for f in files)]
        merged = {
            "baseline": [r["baseline"] for r in ranks],
            "phases": [[r["phases"][i] for r in ranks] for i in range(len(calls))],
            "loss": ranks[0]["phases"][2]["result"],
            "written": written,
        }
        Path(out).write_text(json.dumps(merged))


def _rank(rank: int, port: int, payload: dict[str, Any], out: str) -> None:
    """One rank of the faccel, whole-per-rank and from_pretrained subjects."""
    os.environ.update(rank_env(rank, port, payload["world"]))
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import attrs
    import transformers

    import faccel

    dist = faccel.detect(strategy="fsdp")
    folder, scratch = Path(payload["folder"]), Path(payload["scratch"])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, payload["vocab"], (BATCH, TOKENS), generator=generator)
    box: dict[str, Any] = {}

    def meta_prepare() -> None:
        with torch.device("meta"):
            model = _build(payload)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        box["model"], box["optimizer"] = faccel.prepare(dist, model, optimizer, init="empty")

    def load() -> None:
        faccel.load_model(dist, box["model"], folder)

    def pretrained() -> int:
        box["model"] = transformers.GPT2LMHeadModel.from_pretrained(folder)
        return _real_bytes(box["model"])

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
    _measure(rank, payload, out, (*first, step, save_checkpoint, export))
    faccel.shutdown(dist)


def _accelerate_fsdp_rank(rank: int, port: int, payload: dict[str, Any], out: str) -> None:
    """One rank of the Accelerate FSDP2 subject: Accelerate's FSDP path, forced on the CPU (module doc)."""
    os.environ.update(rank_env(rank, port, payload["world"]))
    os.environ["OMP_NUM_THREADS"] = "1"
    # What `accelerate launch` with an FSDP config sets; transformers reads them in from_pretrained
    # (rank 0 loads, the others build on meta) and Accelerate in its plugin.
    os.environ["ACCELERATE_USE_FSDP"] = "true"
    os.environ["FSDP_CPU_RAM_EFFICIENT_LOADING"] = "true"
    torch.set_num_threads(1)
    import transformers
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, InitProcessGroupKwargs
    from torch.distributed.fsdp import FSDPModule

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        cpu_ram_efficient_loading=True,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["GPT2Block"],
    )
    # A bounded collective timeout: a phase failing on some ranks only must not hang the others forever.
    group = InitProcessGroupKwargs(backend="gloo", timeout=timedelta(seconds=payload["timeout"]))
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin, kwargs_handlers=[group])
    # On the CPU Accelerate chose MULTI_CPU and dropped the plugin: force its FSDP path. The type
    # goes into PartialState's shared state too, as AcceleratorState.__init__ does when it picks FSDP
    # itself: a later AcceleratorState() (AcceleratedOptimizer's, inside prepare) copies PartialState's
    # type over its own, and without this line is_fsdp2 turns False halfway through prepare.
    accelerator.state.fsdp_plugin = plugin
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    folder, scratch = Path(payload["folder"]), Path(payload["scratch"])
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, payload["vocab"], (BATCH, TOKENS), generator=generator)
    box: dict[str, Any] = {}

    def pretrained() -> int:
        box["model"] = transformers.GPT2LMHeadModel.from_pretrained(folder)
        return _real_bytes(box["model"])

    def prepare() -> None:
        optimizer = torch.optim.AdamW(box["model"].parameters(), lr=1e-4)
        box["model"], box["optimizer"] = accelerator.prepare(box["model"], optimizer)
        if not accelerator.is_fsdp2 or not isinstance(box["model"], FSDPModule):
            msg = (
                f"Accelerate did not take its FSDP2 path (distributed type {accelerator.distributed_type}, "
                f"prepared model {type(box['model']).__name__})"
            )
            raise RuntimeError(msg)

    def step() -> float:
        loss = box["model"](input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        box["optimizer"].step()
        box["optimizer"].zero_grad()
        return float(loss.detach())

    def save_state() -> None:
        accelerator.save_state(str(scratch / "checkpoints"))

    def export() -> None:
        accelerator.save_model(box["model"], str(scratch / "export"))

    _measure(rank, payload, out, (pretrained, prepare, step, save_state, export))
    accelerator.end_training()


def _accelerate_probe_rank(rank: int, port: int, payload: dict[str, Any], out: str) -> None:
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
    """One line: what Accelerate does unforced on 2 gloo ranks asked for FSDP2, cpu_ram_efficient_loading."""
    try:
        import accelerate
    except ImportError:
        return "Accelerate's FSDP2 path: not probed (accelerate is not installed)"
    tiny = {"width": 64, "blocks": 2, "heads": 4, "vocab": 256, "positions": 64}
    try:
        found: dict[str, Any] = run_ranks(_accelerate_probe_rank, tiny, what="accelerate probe")  # type: ignore[assignment]
    except Exception as error:  # the probe reports, never fails the benchmark
        return f"Accelerate {accelerate.__version__} FSDP2 path on 2 gloo ranks: failed ({error})"
    if found["fsdp"] or found["sharded"]:
        verdict = (
            "sharded by FSDP2 without forcing: the forcing in the Accelerate FSDP2 subject is not needed"
        )
    else:
        verdict = (
            "NOT sharded: on the CPU Accelerate keeps its MULTI_CPU type and ignores the FSDP plugin "
            "(accelerate/state.py sets FSDP only for GPU-like types), hence the forcing in the "
            "Accelerate FSDP2 subject"
        )
    return (
        f"probe, unforced: Accelerate {accelerate.__version__}, "
        f"FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=True), "
        f"Accelerator(cpu=True) on 2 gloo ranks: distributed type "
        f"{found['distributed_type']}, is_fsdp2 {found['is_fsdp2']}, prepared model {found['model']}; "
        f"{verdict}"
    )


def mem_available() -> int:
    """``MemAvailable`` of ``/proc/meminfo``, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    msg = "no MemAvailable in /proc/meminfo"
    raise RuntimeError(msg)


def _failed(ranks: list[dict[str, Any]]) -> str | None:
    """The error of a phase (rank 0's text, or the first failing rank's), None if no rank failed."""
    errors = [(r, f["error"]) for r, f in enumerate(ranks) if f["error"] is not None]
    if not errors:
        return None
    where = "all ranks" if len(errors) == len(ranks) else f"ranks {[r for r, _ in errors]}"
    return f"failed on {where}: {errors[0][1]}"


def _seconds(subject: dict[str, Any] | None, names: tuple[str, ...], phases: tuple[str, ...]) -> float | str:
    """The summed seconds (slowest rank) of ``names`` in a subject's run, or why there is no figure."""
    if subject is None or "skipped" in subject:
        return "not run" if subject is None else str(subject["skipped"])
    total = 0.0
    for name in names:
        ranks = subject["phases"][phases.index(name)]
        error = _failed(ranks)
        if error:
            return f"{name} {error}"
        total += max(r["seconds"] for r in ranks)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, help="gloo ranks")
    parser.add_argument("--width", type=int, default=1280)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument(
        "--subjects",
        default=DEFAULT_SUBJECTS,
        help=f"comma-separated, of {', '.join(KEYS)} (default {DEFAULT_SUBJECTS})",
    )
    parser.add_argument("--timeout", type=int, default=1800, help="seconds a subject may take in all")
    parser.add_argument("--scratch", default=None, help="folder for the files (default: a temporary one)")
    parser.add_argument("--accelerate-probe-only", action="store_true", help="only the Accelerate probe")
    args = parser.parse_args(argv)
    if args.accelerate_probe_only:
        print(accelerate_probe(), flush=True)
        return 0
    unknown = [key for key in args.subjects.split(",") if key not in KEYS]
    if unknown:
        parser.error(f"unknown subjects {unknown}; known: {', '.join(KEYS)}")
    subjects = [KEYS[key] for key in KEYS if key in args.subjects.split(",")]
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    payload: dict[str, Any] = {
        "width": args.width,
        "blocks": args.blocks,
        "heads": args.heads,
        "vocab": args.vocab,
        "positions": args.positions,
        "world": args.world,
        "timeout": args.timeout,
    }
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="faccel-bench-"))
    got: dict[str, dict[str, Any]] = {}
    notes: list[str] = []
    started = time.perf_counter()
    try:
        folder = scratch / "start"
        torch.manual_seed(0)
        model = _build(payload)
        parameters = sum(p.numel() for p in model.parameters())  # the tied head counted once
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        model.save_pretrained(folder)
        del model
        gc.collect()
        print(
            f"model: GPT-2, width {args.width}, {args.blocks} blocks, {args.heads} heads, vocabulary "
            f"{args.vocab}, {args.positions} positions: {parameters / 1e6:.1f}M parameters, "
            f"{model_bytes / GB:.3f} GB in float32; AdamW; FSDP2 on {args.world} gloo ranks",
            flush=True,
        )
        for subject in subjects:
            if subject == ACCELERATE:
                try:
                    import accelerate  # noqa: F401
                except ImportError:
                    got[subject] = {"skipped": "skipped: accelerate is not installed"}
                    continue
            if subject == WHOLE:
                own, available = rss_bytes(), mem_available()
                need = args.world * (2 * model_bytes + own)
                if need > MEMORY_SHARE * available:
                    got[subject] = {
                        "skipped": (
                            f"skipped: estimated {need / GB:.1f} GB ({args.world} ranks x (2 x "
                            f"{model_bytes / GB:.2f} GB model + {own / GB:.2f} GB interpreter)) is over "
                            f"{MEMORY_SHARE:.0%} of MemAvailable {available / GB:.1f} GB"
                        )
                    }
                    continue
                notes.append(
                    f"whole per rank: estimated {need / GB:.1f} GB in all, within {MEMORY_SHARE:.0%} of "
                    f"MemAvailable {available / GB:.1f} GB"
                )
            work = scratch / subject.replace(" ", "-")
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            run = {**payload, "subject": subject, "folder": str(folder), "scratch": str(work)}
            target = _accelerate_fsdp_rank if subject == ACCELERATE else _rank
            try:
                got[subject] = run_ranks(  # type: ignore[assignment]
                    target, run, what=subject, world_size=args.world, timeout=args.timeout
                )
            except Exception as error:  # a subject's processes failing is reported, not fatal
                got[subject] = {"skipped": f"failed: {_error_text(error)}"}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    _report(args.world, parameters, model_bytes, subjects, got, notes)
    print(f"benchmark wall clock: {time.perf_counter() - started:.1f} s", flush=True)
    print(accelerate_probe(), flush=True)
    return 0


def _report(
    world: int,
    parameters: int,
    model_bytes: int,
    subjects: list[str],
    got: dict[str, dict[str, Any]],
    notes: list[str],
) -> None:
    ranks = range(world)
    for note in notes:
        print(note)
    print(
        "baseline: resident size before the first phase (imports, process group, a meta build), GB per rank:"
    )
    for subject in subjects:
        if "skipped" in got[subject]:
            continue
        values = " ".join(f"{b / GB:.2f}" for b in got[subject]["baseline"])
        print(f"  {subject:<16} {values}")
    print(
        "peak: absolute peak resident size in the phase, GB; rise / held: its rise during / after the phase,"
    )
    print("x the whole model's bytes; seconds: the slowest rank's")

    def cells(what: str) -> str:
        return " ".join(f"{what + ' r' + str(r):>8}" for r in ranks)

    print(f"{'subject':<16} {'phase':<16} {cells('peak')}  {cells('rise')}  {cells('held')}  seconds")
    for subject in subjects:
        result = got[subject]
        if "skipped" in result:
            print(f"{subject:<16} {result['skipped']}")
            continue
        for name, figures in zip(PHASES[subject], result["phases"], strict=True):
            error = _failed(figures)
            seconds = max(f["seconds"] for f in figures)
            if error:
                print(f"{subject:<16} {name:<16} {error} ({seconds:.1f} s)")
                continue
            peak = " ".join(f"{f['peak'] / GB:8.2f}" for f in figures)
            rise = " ".join(f"{(f['peak'] - f['before']) / model_bytes:8.2f}" for f in figures)
            held = " ".join(f"{(f['after'] - f['before']) / model_bytes:8.2f}" for f in figures)
            print(f"{subject:<16} {name:<16} {peak}  {rise}  {held}  {seconds:7.1f}")
    losses = [
        f"{subject} {'n/a' if got[subject].get('loss') is None else format(got[subject]['loss'], '.6f')}"
        for subject in subjects
    ]
    print("loss of the step: " + ", ".join(losses))
    for subject in subjects:
        if "skipped" in got[subject]:
            continue
        if PHASES[subject][0] == "from_pretrained":
            real = [f["result"] for f in got[subject]["phases"][0]]
            shown = " ".join("failed" if b is None else f"{b / GB:.3f}" for b in real)
            print(f"{subject} from_pretrained: parameters not on meta, GB per rank: {shown}")
        (files, size), (exports, export) = (
            got[subject]["written"]["checkpoints"],
            got[subject]["written"]["export"],
        )
        print(
            f"{subject} wrote: checkpoint {size / GB:.3f} GB in {files} files, "
            f"export {export / GB:.3f} GB in {exports} files"
        )
    print("times: wall clock on a small shared machine, indicative only")
    _ratios(subjects, got)
    if FACCEL not in subjects or "skipped" in got[FACCEL]:
        return
    phases = dict(zip(PHASES[FACCEL], got[FACCEL]["phases"], strict=True))
    bounded = [(name, max((f["peak"] - f["before"]) / model_bytes for f in phases[name])) for name in BOUNDED]
    broken = [name for name in BOUNDED if _failed(phases[name])]
    met = not broken and all(rise <= BOUND for _, rise in bounded)
    detail = ", ".join(f"{name} {'failed' if name in broken else f'{rise:.2f}x'}" for name, rise in bounded)
    print(
        f"criterion (memory: no rank's peak rise over {BOUND}x the model in {', '.join(BOUNDED)}): "
        f"{'met' if met else 'NOT met'} ({detail})"
    )
    share = BYTES_PER_PARAMETER * parameters / world
    limit = SLACK * share + FLOOR
    worst = [(name, max(f["peak"] for f in figures)) for name, figures in phases.items()]
    broken = [name for name in phases if _failed(phases[name])]
    met = not broken and all(peak <= limit for _, peak in worst)
    detail = ", ".join(f"{name} {'failed' if name in broken else f'{peak / GB:.2f}'}" for name, peak in worst)
    baseline = max(got[FACCEL]["baseline"])
    print(
        f"target (every faccel phase's per-rank peak <= {SLACK} x {BYTES_PER_PARAMETER} B x "
        f"{parameters / 1e6:.1f}M / {world} + {FLOOR / 1e6:.0f} MB = {SLACK} x {share / GB:.3f} + "
        f"{FLOOR / GB:.3f} = {limit / GB:.3f} GB): "
        f"{'met' if met else 'NOT met'} (largest rank's peak, GB: {detail}); the baseline before the model "
        f"is {baseline / GB:.3f} GB of it (largest rank)"
    )


def _ratios(subjects: list[str], got: dict[str, dict[str, Any]]) -> None:
    """faccel's load, checkpoint and export times over Accelerate's, or why there is no ratio."""
    if FACCEL not in subjects or ACCELERATE not in subjects:
        return
    pairs = (
        (
            "load",
            ("prepare (meta)", "load_model"),
            ("from_pretrained", "prepare"),
            "from_pretrained + prepare",
        ),
        ("checkpoint", ("checkpoint",), ("checkpoint",), "save_state"),
        ("export", ("save_model",), ("save_model",), "save_model"),
    )
    for what, ours, theirs, called in pairs:
        mine = _seconds(got[FACCEL], ours, PHASES[FACCEL])
        other = _seconds(got[ACCELERATE], theirs, PHASES[ACCELERATE])
        left = f"faccel ({' + '.join(ours)}) {mine:.1f} s" if isinstance(mine, float) else f"faccel {mine}"
        right = (
            f"Accelerate ({called}) {other:.1f} s"
            if isinstance(other, float)
            else f"Accelerate: no figure, {other}"
        )
        ratio = (
            f": faccel / Accelerate {mine / other:.2f}"
            if isinstance(mine, float) and isinstance(other, float) and other > 0
            else ""
        )
        print(f"{what} time: {left}, {right}{ratio}")


if __name__ == "__main__":
    sys.exit(main())
