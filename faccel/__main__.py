"""The command line: ``python -m faccel env [--json]``, ``convert SOURCE TARGET``, ``plot RUN``,
``consolidate CKPT OUT``, ``plan (--hf-config CONFIG | --model MODULE:FUNCTION) --world-size N``.

Every argument is checked before any work (paths exist and are of the right kind, numbers in their
range, files regular and small enough), so a hostile command line ends with one line on stderr and a
non-zero status, never a traceback or a hang. Exit status: 0 on success, 1 when ``env``'s report
found a problem (each is printed with its fix) or a command was refused or failed (one line:
the error's class and message), 2 for a usage error (one line from the argument parser).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

# The largest world size plan accepts: a million ranks (its arithmetic is per rank of one grid).
MAX_WORLD_SIZE = 1 << 20
# The largest --batch-size and, for a config without a position limit, --seq-len.
MAX_BATCH = 1 << 20
MAX_SEQ_LEN = 1 << 20
# The keys of a transformers config that hold a size or a count (n_layer, hidden_size, num_heads ...).
_SIZE_KEY = re.compile(r"^(n|num)_|_(size|layers|heads|dim|positions)$|^n(layer|embd|head|ctx)$")
# The largest --hf-config file read: a transformers config.json is a few KB.
MAX_CONFIG_BYTES = 1 << 20


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors on one line: ``prog: error: ... (usage: prog ...; see --help)``."""

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split())
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} ({usage}; see --help)\n")


def _refuse(message: str) -> NoReturn:
    from faccel.errors import ArgumentValueError

    raise ArgumentValueError(message)


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


def _check_folders(command: str, source: str, what: str, target: str, size: str) -> None:
    """A source folder that exists, a target that is not one of its files, a shard size that parses."""
    from faccel._hf._save_model import parse_size
    from faccel._storage._roots import is_url, refuse_url

    if not source:
        _refuse(f"{command}: {what} is empty")
    if command != "consolidate":  # consolidate reads a checkpoint on object storage
        refuse_url(source, what=f"{command}: {what}")
    refuse_url(target, what=f"{command}: the output folder")
    if not is_url(source) and not Path(source).exists():
        _refuse(f"{command}: {what} {source} does not exist")
    if not target:
        _refuse(f"{command}: the output folder is empty")
    if Path(target).exists() and not Path(target).is_dir():
        _refuse(f"{command}: the output {target} exists and is not a folder; give a folder")
    parse_size(size)


def _convert(args: argparse.Namespace) -> int:
    from faccel._hf._save_model import convert_weights

    _check_folders("convert", args.source, "the source", args.target, args.max_shard_size)
    if not Path(args.source).is_dir():
        _refuse(f"convert: the source {args.source} is not a folder; give the folder with pytorch_model.bin")
    out = convert_weights(args.source, args.target, max_shard_size=args.max_shard_size)
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")
    return 0


def _consolidate(args: argparse.Namespace) -> int:
    from faccel._hf._consolidate import consolidate

    _check_folders("consolidate", args.checkpoint, "the checkpoint", args.out, args.max_shard_size)
    out = consolidate(
        args.checkpoint, args.out, max_shard_size=args.max_shard_size, allow_sparse=args.allow_sparse
    )
    print(f"wrote {', '.join(sorted(p.name for p in out.iterdir()))} to {out}")
    return 0


def _config_dict(config_path: str) -> tuple[Path, dict[str, Any]]:
    """The JSON object of a ``config.json`` (or its folder's), read bounded from a regular file."""
    from faccel._report._metrics_file import open_user_file

    path = Path(config_path)
    if not config_path or not path.exists():
        _refuse(
            f"--hf-config {config_path!r} does not exist; give a config.json or the folder that holds one"
        )
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            _refuse(f"--hf-config {config_path}: the folder holds no config.json")
    data = open_user_file(path, what="--hf-config", limit=MAX_CONFIG_BYTES)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        _refuse(f"--hf-config {path} is not UTF-8 text; give a transformers config.json")
    try:
        config = json.loads(text)
    except RecursionError:
        _refuse(f"--hf-config {path} is nested too deep to be a model's config")
    except ValueError as error:
        _refuse(f"--hf-config {path} is not JSON ({error}); give a transformers config.json")
    if not isinstance(config, dict):
        _refuse(f"--hf-config {path} holds a {type(config).__name__}, not a JSON object; give a config.json")
    if not isinstance(config.get("model_type"), str):
        _refuse(f"--hf-config {path} has no model_type (text), which transformers needs to pick the model")
    return path, config


def _hf_model(config_path: str) -> tuple[Callable[[], Any], int | None]:
    """A function building the causal LM of a transformers ``config.json`` (or its folder); its length."""
    path, data = _config_dict(config_path)
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        _refuse("--hf-config needs transformers (pip install transformers); or pass --model module:function")
    model_type = data.pop("model_type")
    for key, value in data.items():
        # A size below 0 (n_layer=-3) builds an empty model whose plan is a table of zeros.
        if _SIZE_KEY.search(key) and type(value) is int and value < 0:
            _refuse(f"--hf-config {path}: {key} is {value}, and a size or count is 0 or more; fix the config")
    try:
        config = AutoConfig.for_model(model_type, **data)
    except Exception as error:  # transformers raises several kinds for a config it cannot read
        said = " ".join(str(error).split())[:200]
        _refuse(
            f"--hf-config {path}: transformers cannot make a config of model_type {model_type!r} ({said})"
        )
    limits = [getattr(config, key, None) for key in ("max_position_embeddings", "n_positions")]
    positions = next((n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0), None)
    return _guarded(lambda: AutoModelForCausalLM.from_config(config), str(path)), positions


def _guarded(build: Callable[[], Any], source: str) -> Callable[[], Any]:
    """``build``, with whatever the user's code raises named (the plan builds it with no storage)."""

    def guarded() -> Any:
        try:
            return build()
        except Exception as error:
            message = " ".join(str(error).split())[:300]
            _refuse(f"plan could not build the model of {source} ({type(error).__name__}: {message})")

    return guarded


def _model_function(spec: str) -> Callable[[], Any]:
    """The function ``MODULE:FUNCTION`` names, imported and checked before the plan."""
    import importlib

    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        _refuse(f"--model names a function as module:function, got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # the user's module: anything it raises while importing
        _refuse(f"--model {spec}: could not import {module_name} ({type(error).__name__}: {error})")
    fn = getattr(module, function, None)
    if not callable(fn):
        _refuse(f"--model {spec}: the module {module_name} has no function {function!r}")
    return _guarded(fn, spec)


def _check_range(name: str, value: int | None, low: int, high: int, why: str = "") -> None:
    if value is None:
        return
    if value < low:
        _refuse(f"{name} must be at least {low}, got {value}")
    if value > high:
        _refuse(f"{name} must be at most {high}{why}, got {value}")


def _schedule(args: argparse.Namespace) -> object:
    """The pipeline schedule the plan's ``pp:P`` candidates assume (``--schedule``, ``--microbatches``)."""
    from faccel._loop._strategies._pipeline._stages import Schedule

    return Schedule(kind=args.schedule, microbatches=args.microbatches)


def _plan(args: argparse.Namespace) -> int:
    from faccel._report._memory_plan import OPTIMIZER_STATES, estimate_memory

    _check_range("--world-size", args.world_size, 1, MAX_WORLD_SIZE)
    _check_range("--batch-size", args.batch_size, 1, MAX_BATCH)
    # --seq-len's upper bound is the model's positions where its config gives them (below).
    _check_range("--seq-len", args.seq_len, 1, MAX_SEQ_LEN if args.hf_config is None else sys.maxsize)
    layouts = [part.strip() for part in args.layouts.split(",")]
    if not all(layouts):
        _refuse(f"--layouts is a comma-separated list of candidates (ddp, fsdp, ...), got {args.layouts!r}")
    if args.optimizer not in OPTIMIZER_STATES:
        _refuse(f"--optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {args.optimizer!r}")
    inputs: object = None
    if args.hf_config is not None:
        model, positions = _hf_model(args.hf_config)
        if positions is not None:
            _check_range("--seq-len", args.seq_len, 1, positions, " (the model's positions)")
        else:
            _check_range("--seq-len", args.seq_len, 1, MAX_SEQ_LEN)
        length = args.seq_len or min(512, positions or 512)
        if args.activations:
            import torch

            # One element, broadcast: only shapes are read, so nothing of batch x length is allocated.
            ids = torch.zeros((), dtype=torch.long).expand(args.batch_size, length)
            inputs = {"input_ids": ids}
    else:
        model = _model_function(args.model)
    _check_range("--microbatches", args.microbatches, 1, MAX_BATCH)
    split = [part.strip() for part in args.split.split(",")] if args.split else None
    try:
        schedule = _schedule(args)
    except (TypeError, ValueError) as error:
        _refuse(f"--schedule/--microbatches: {error}")
    plan = estimate_memory(
        model,
        args.world_size,
        layouts,
        optimizer=args.optimizer,
        inputs=inputs,
        split=split,
        schedule=schedule,
    )
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(plan)
    return 0


def _plot(args: argparse.Namespace) -> int:
    from faccel._report._metrics_file import plot
    from faccel._storage._roots import refuse_url

    if not args.run:
        _refuse("plot: RUN is empty; give a run's folder (with metrics.jsonl) or the file itself")
    refuse_url(args.run, what="plot: RUN")
    if args.out is not None and not args.out:
        _refuse("plot: --out is empty; give the image's path (e.g. RUN/metrics.png)")
    print(f"wrote {plot(args.run, args.out)}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m faccel",
        description="faccel's command line. Exit status: 0 on success, 1 when the report lists "
        "a problem (env) or a command is refused or fails (one line on stderr), 2 for a usage error.",
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
        description="Draw every metric of RUN/metrics.jsonl against its step into one image "
        "(needs matplotlib). Reads a regular file of at most 64 MiB, lines of at most 1 MiB, "
        "and draws at most 64 metrics.",
    )
    plot.add_argument("run", help="the run's folder (or its metrics.jsonl)")
    plot.add_argument(
        "--out",
        default=None,
        help="the image to write (.png, .pdf or .svg) in a folder that exists (default RUN/metrics.png)",
    )
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
    plan.add_argument(
        "--world-size", type=int, required=True, help=f"ranks of the job (1 to {MAX_WORLD_SIZE})"
    )
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
    plan.add_argument(
        "--batch-size",
        type=int,
        default=1,
        help=f"sequences per rank (--hf-config; default 1, at most {MAX_BATCH})",
    )
    plan.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="tokens per sequence (--hf-config; default min(512, max); at most the model's positions)",
    )
    plan.add_argument(
        "--no-activations", dest="activations", action="store_false", help="skip the meta forward"
    )
    plan.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in ``argv`` (``sys.argv[1:]`` by default); return the exit status.

    The status is 1 when ``env`` reports a problem (what would make ``detect()``
    fail or the run misbehave) or a command is refused or fails, each with one line
    on stderr, else 0; a usage error exits with 2.
    """
    args = _parser().parse_args(argv)

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
        print(_one_line(f"{type(error).__name__}: {error}"), file=sys.stderr)
    except OSError as error:  # the disk or the file system refused, where no faccel error names it
        print(_one_line(f"python -m faccel {args.command}: {error}"), file=sys.stderr)
    except KeyboardInterrupt:
        print(f"python -m faccel {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # never a traceback for a command line: one line, and say it is a bug
        print(
            _one_line(
                f"python -m faccel {args.command}: unexpected {type(error).__name__}: {error} (a bug in "
                "faccel: please report it with the command line)"
            ),
            file=sys.stderr,
        )
    return 1


if __name__ == "__main__":
    sys.exit(main())
