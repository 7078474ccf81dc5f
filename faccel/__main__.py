"""The command line: ``python -m faccel env [--json]``, ``convert SOURCE TARGET``, ``plot RUN``,
``consolidate CKPT OUT``, ``plan (--hf-config CONFIG | --model MODULE:FUNCTION) --world-size N``.

Exit status: 0 on success, 1 when ``env``'s report found a problem (each is
printed with its fix) or a command failed with a faccel error, 2 for a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence


def _env(args: argparse.Namespace) -> int:
    from faccel._dist._env_report import (
        collect_hardware,
        collect_versions,
        env_report,
        render_text,
        report_dict,
    )

    report = env_report(os.environ, versions=collect_versions(), hardware=collect_hardware())
    if args.json:
        json.dump(report_dict(report), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render_text(report))
    return 1 if report.problems else 0


def _convert(args: argparse.Namespace) -> int:
    from faccel._hf._save_model import convert_weights

    out = convert_weights(args.source, args.target, max_shard_size=args.max_shard_size)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from faccel._hf._consolidate import consolidate

    out = consolidate(
        args.checkpoint, args.out, max_shard_size=args.max_shard_size, allow_sparse=args.allow_sparse
    )
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")
    return 0


def _hf_model(config_path: str) -> tuple[object, dict[str, object]]:
    """A function building the causal LM of a transformers ``config.json`` (or its folder); its length."""
    from pathlib import Path

    from faccel.errors import ArgumentValueError

    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        msg = "--hf-config needs transformers (pip install transformers); or pass --model module:function"
        raise ArgumentValueError(msg) from None
    path = Path(config_path)
    if not path.exists():
        msg = f"--hf-config {config_path!r} does not exist; give a config.json or the folder that holds one"
        raise ArgumentValueError(msg)
    config = AutoConfig.from_pretrained(path.parent if path.is_file() else path)
    limits = [getattr(config, key, None) for key in ("max_position_embeddings", "n_positions")]
    return (lambda: AutoModelForCausalLM.from_config(config)), {
        "positions": next((n for n in limits if n), None)
    }


def _schedule(args: argparse.Namespace) -> object:
    """The pipeline schedule the plan's ``pp:P`` candidates assume (``--schedule``, ``--microbatches``)."""
    from faccel._loop._pipeline import Schedule

    return Schedule(kind=args.schedule, microbatches=args.microbatches)


def _plan(args: argparse.Namespace) -> int:
    import torch

    from faccel._report._memory_plan import estimate_memory

    if args.hf_config:
        model, facts = _hf_model(args.hf_config)
        length = args.seq_len or min(512, int(facts["positions"] or 512))  # type: ignore[call-overload]
        inputs: object = {"input_ids": torch.zeros(args.batch_size, length, dtype=torch.long)}
        if not args.activations:
            inputs = None
    else:
        model, inputs = args.model, None
    plan = estimate_memory(
        model,  # type: ignore[arg-type]
        args.world_size,
        args.layouts.split(","),
        optimizer=args.optimizer,
        inputs=inputs,
        split=args.split.split(",") if args.split else None,
        schedule=_schedule(args),
    )
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(plan)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from faccel._report._tracking import plot

    print(f"wrote {plot(args.run, args.out)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in ``argv`` (``sys.argv[1:]`` by default); return the exit status.

    The status is 1 when ``env`` reports a problem (what would make ``detect()``
    fail or the run misbehave) or a command fails with a faccel error, else 0.
    """
    parser = argparse.ArgumentParser(
        prog="python -m faccel",
        description="faccel's command line. Exit status: 0 on success, 1 when the report lists "
        "a problem (env) or a command fails, 2 for a usage error.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    env = commands.add_parser(
        "env",
        help="versions, devices, what detect() sees here and why, and problems found",
        description="Report what faccel sees in this environment; paste it into bug reports. "
        "Never starts a process group. Exits with status 1 when the report lists a problem.",
    )
    env.add_argument("--json", action="store_true", help="machine-readable output")
    convert = commands.add_parser(
        "convert",
        help="rewrite pytorch_model.bin weights (or their shards) as safetensors",
        description="Read SOURCE's weights as load_model does (.bin files through torch's restricted "
        "loader, which runs nothing) and write them to TARGET in the safetensors layout, with "
        "config.json and generation_config.json copied.",
    )
    convert.add_argument("source", help="folder with pytorch_model.bin or its index")
    convert.add_argument("target", help="folder to write model.safetensors (or shards) into")
    convert.add_argument("--max-shard-size", default="5GB", help="largest shard (default 5GB)")
    consolidate = commands.add_parser(
        "consolidate",
        help="write a checkpoint's model weights in the Hugging Face layout (model.safetensors)",
        description="Read CKPT's model tensors one at a time (any world size wrote it, sharded or "
        "not; every byte checked against its checksum) and write them to OUT as save_model does: "
        "model.safetensors, or shards and model.safetensors.index.json. No process group; peak "
        "memory about the largest tensor.",
    )
    consolidate.add_argument("checkpoint", help="a checkpoint folder (step-NNNNNNNNNNNN) or a root of them")
    consolidate.add_argument("out", help="a new folder to write model.safetensors (or shards) into")
    consolidate.add_argument("--max-shard-size", default="5GB", help="largest file (default 5GB)")
    consolidate.add_argument(
        "--allow-sparse",
        action="store_true",
        help="write weights that claim more than the files occupy on disk (a compressing file system)",
    )
    plot = commands.add_parser(
        "plot",
        help="draw a run's logged metrics (faccel.init_tracker's jsonl) to a PNG",
        description="Draw every metric of RUN/metrics.jsonl against its step into one PNG "
        "(needs matplotlib).",
    )
    plot.add_argument("run", help="the run's folder (or its metrics.jsonl)")
    plot.add_argument("--out", default=None, help="the PNG to write (default RUN/metrics.png)")
    plan = commands.add_parser(
        "plan",
        help="bytes per rank of parameters, gradients, optimizer state and activations for each layout",
        description="Build the model on the meta device (no memory) and print, for each candidate "
        "layout, what the largest rank holds: parameters, gradients, optimizer state, buffers, what a "
        "step holds in flight, activations of one forward (with --hf-config), and the largest tensor "
        "(what a sharded save or load holds at once). Accelerate's `accelerate estimate-memory`.",
    )
    source = plan.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf-config", help="a transformers config.json (or its folder): its causal LM")
    source.add_argument("--model", help="MODULE:FUNCTION, a function that builds the model (called on meta)")
    plan.add_argument("--world-size", type=int, required=True, help="ranks of the job")
    plan.add_argument(
        "--layouts",
        default="ddp,fsdp",
        help="comma-separated candidates: ddp, fsdp, hsdp:RxS, tp:T, pp:P, RxSxT (default ddp,fsdp)",
    )
    plan.add_argument(
        "--split", default=None, help="pp:P: module names where a stage begins, comma-separated"
    )
    plan.add_argument(
        "--schedule", default="1f1b", help="pp:P: gpipe, 1f1b, interleaved_1f1b, zero_bubble or zbv"
    )
    plan.add_argument("--microbatches", type=int, default=None, help="pp:P: micro-batches per batch")
    plan.add_argument("--optimizer", default="adamw", help="adamw, adam, sgd (momentum) or none")
    plan.add_argument("--batch-size", type=int, default=1, help="sequences per rank (--hf-config; default 1)")
    plan.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (--hf-config; default min(512, max))"
    )
    plan.add_argument(
        "--no-activations", dest="activations", action="store_false", help="skip the meta forward"
    )
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)

    from faccel.errors import FaccelError

    handlers: dict[str, Callable[[argparse.Namespace], int]] = {
        "env": _env,
        "convert": _convert,
        "consolidate": _consolidate,
        "plot": _plot,
        "plan": _plan,
    }
    try:
        return handlers[args.command](args)
    except FaccelError as error:
        print(f"{type(error).__name__}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
