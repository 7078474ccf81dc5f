"""Run the benchmarks side by side and write docs/benchmarks.md and benchmarks/results.json.

    python benchmarks/run.py                  # everything, full rounds (minutes; a quiet machine)
    python benchmarks/run.py --quick          # everything, few rounds (about four minutes on 2 cores)
    python benchmarks/run.py --only step ddp  # some modules; their results replace the old ones
    python benchmarks/run.py --list           # the registry
    python benchmarks/run.py --render         # docs/benchmarks.md again from results.json

Every ``benchmarks/bench_NAME.py`` with a ``run(quick: bool) -> list[Row]`` is a benchmark
named NAME (see README.md in this folder). The anchors (Accelerate, Lightning Fabric) come
from the ``bench`` extra: ``pip install -c constraints.txt -e '.[bench]'``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
if str(ROOT) not in sys.path:  # `python benchmarks/run.py` puts only this folder on the path
    sys.path.insert(0, str(ROOT))

import attrs  # noqa: E402 (after the path fix above)

from benchmarks.common import ACCELERATE, FABRIC, FACCEL, GOALS, Row  # noqa: E402

RESULTS = HERE / "results.json"
DOC = ROOT / "docs" / "benchmarks.md"

# Display order; modules not listed come after, by name.
ORDER = (
    "step",
    "accumulation",
    "data",
    "import",
    "checkpoint",
    "functional",
    "ddp",
    "deepspeed",
    "parallel",
    "eval_forward",
)
# Benchmarks other issues own: shown as pending until their module exists.
PLANNED: Mapping[str, str] = {
    "accumulation": "step time with 4 micro-steps of accumulation vs manual accumulation "
    f"(target <= {GOALS['accumulation'][FACCEL]}); benchmarks/bench_accumulation.py",
    "checkpoint": "durable checkpoint save and restore, 50M parameters + AdamW, vs torch.save + fsync, "
    "beside the disk's write and read bandwidth; benchmarks/bench_checkpoint.py",
    "functional": "gradient sync for torch.func code and a functional step; benchmarks/bench_functional.py",
}
# Each line of the GOALS table: the benchmark that applies it, and what its figures compare.
GOAL_MEANINGS: Mapping[str, str] = {
    "step": "step: time per training step / plain PyTorch's (small and medium MLP)",
    "accumulation": "accumulation: time per micro-step, 4 micro-steps a step / manual accumulation's",
    "batch_iteration": "data: time per batch from the prepared loader / the plain DataLoader's",
    "import": "import: seconds the import adds to `import torch`",
    "checkpoint": "checkpoint: durable save time, 50M-parameter MLP + AdamW / `torch.save` + fsync",
    "restore": "checkpoint: verified restore time, the same / `torch.load(weights_only=True)` + load",
    "ddp_step": "ddp: time per step, 2 gloo processes / plain DDP's",
    "deepspeed_step": "deepspeed: time per ZeRO-2 step, 2 gloo processes / DeepSpeed's own loop's",
    "parallel_step": "parallel: time per step, 4 gloo processes per layout / the same step by hand",
    "exact_step": "exact: time per step in exact mode (8 atoms), 2 and 4 gloo processes / ordinary DDP's",
    "eval_forward": "eval_forward: time per FSDP2 forward under no_grad, 2 gloo processes / by hand",
    "moe": "moe: time per step of a Mixtral-like layer at expert=2, 2 gloo processes / the dispatch by hand",
    "moe_memory": "moe: peak memory per rank at expert=2 / FSDP2's without expert parallelism",
    "observe_step": "observe: time per step with faccel.measure once a step / the same loop without it",
    "ft_step": "ft: time per fault-tolerant step (quorum, gather, commit), 3 gloo processes / DDP's",
}


def discover() -> dict[str, Path]:
    """Benchmark name -> module file, in display order."""
    found = {path.stem.removeprefix("bench_"): path for path in HERE.glob("bench_*.py")}
    rank = {name: index for index, name in enumerate(ORDER)}
    return {name: found[name] for name in sorted(found, key=lambda n: (rank.get(n, len(ORDER)), n))}


def coerce(item: Any, bench: str) -> Row:
    """A module's row as a :class:`Row` of this benchmark, whatever record type it came in."""
    if isinstance(item, Row):
        return attrs.evolve(item, bench=bench)
    if isinstance(item, Mapping):
        fields = dict(item)
    elif attrs.has(type(item)):
        fields = attrs.asdict(item)
    elif hasattr(item, "__dataclass_fields__"):
        fields = {name: getattr(item, name) for name in item.__dataclass_fields__}
    else:
        msg = f"bench_{bench}.run() returned a {type(item).__name__}; expected Row (benchmarks.common)"
        raise TypeError(msg)
    known = {field.name for field in attrs.fields(Row)}
    return Row(
        **{key: value for key, value in fields.items() if key in known and key != "bench"}, bench=bench
    )


# ---- formatting -------------------------------------------------------------------------


def _num(value: float) -> str:
    """Three significant figures, without scientific notation for everyday sizes."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def _cmp(row: Row, value: float | None) -> str:
    if value is None:
        return ""
    if row.compare == "difference":
        return f"{value:+.3f} {row.unit}"
    return f"{value:.3f}"


def _bound(row: Row, value: float) -> str:
    return f"{value:+.2f} {row.unit}" if row.compare == "difference" else f"{value:.2f}"


def _goal(row: Row) -> str:
    if row.target is not None:
        verdict = "met" if row.met else "MISSED"
        return f"target <= {_bound(row, row.target)}: {verdict}"
    if row.reference is not None:
        return f"reference: {_bound(row, row.reference)}"
    return ""


def _cells(row: Row) -> list[str]:
    spread = f"{_cmp(row, row.low)} to {_cmp(row, row.high)}" if row.low is not None else ""
    note = f" ({row.note})" if row.note else ""
    return [row.subject + note, f"{_num(row.value)} {row.unit}", _cmp(row, row.median), spread, _goal(row)]


def _cases(rows: Iterable[Row]) -> dict[str, list[Row]]:
    cases: dict[str, list[Row]] = {}
    for row in rows:
        cases.setdefault(row.case, []).append(row)
    return cases


def _versus(rows: Sequence[Row]) -> str:
    baselines = {row.baseline for row in rows if row.baseline}
    kinds = {row.compare for row in rows if row.baseline}
    if not baselines:
        return "comparison"
    word = "minus" if kinds == {"difference"} else "/"
    return f"{word} {', '.join(sorted(baselines))} (median)"


def text_table(rows: Sequence[Row]) -> str:
    """The rows of one module as aligned text, one block per case."""
    lines = []
    for case, members in _cases(rows).items():
        lines.append(f"  {case}: {members[0].rounds} rounds")
        header = ["subject", "median", _versus(members), "min to max", "goal"]
        table = [header, *(_cells(row) for row in members)]
        widths = [max(len(r[i]) for r in table) for i in range(len(header))]
        lines += [
            "    " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
            for r in table
        ]
    return "\n".join(lines)


def markdown_table(rows: Sequence[Row]) -> str:
    """The rows of one module as Markdown tables, one per case."""
    parts = []
    for case, members in _cases(rows).items():
        header = ["subject", "median", _versus(members), "min to max", "goal"]
        lines = [
            f"**{case}** ({members[0].rounds} rounds)",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
        ]
        lines += ["| " + " | ".join(_cells(row)) + " |" for row in members]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def summary_table(rows: Sequence[Row]) -> str:
    """faccel against its targets, and the anchors measured in the same rounds."""
    lines = [
        "| benchmark | case | faccel | min to max | target | | Accelerate (reference) | Fabric (reference) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    # By benchmark and case: two benchmarks may share a case's words (observe and step both time
    # the small MLP), and one must not hide the other.
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.bench, row.case), []).append(row)
    for (_, case), members in groups.items():
        by = {row.subject: row for row in members}
        mine = by.get(FACCEL)
        if mine is None or mine.median is None:
            continue

        def anchor(name: str, by: Mapping[str, Row] = by) -> str:
            row = by.get(name)
            if row is None or row.median is None:
                return "not run"
            design = f" ({_bound(row, row.reference)})" if row.reference is not None else ""
            return _cmp(row, row.median) + design

        target = _bound(mine, mine.target) if mine.target is not None else ""
        verdict = "" if mine.met is None else ("met" if mine.met else "**missed**")
        lines.append(
            f"| {mine.bench} | {case} | {_cmp(mine, mine.median)} | {_cmp(mine, mine.low)} to "
            f"{_cmp(mine, mine.high)} | {target} | {verdict} | {anchor('Accelerate')} | {anchor('Fabric')} |"
        )
    return "\n".join(lines)


def goals_section() -> str:
    """What the targets and the anchors' reference figures are, from ``GOALS`` itself."""
    lines = [
        "## Targets and reference figures",
        "",
        "A target is the project's bound on faccel's median paired comparison with plain PyTorch "
        "in that benchmark (met when the median is at or below it). The anchors' reference figures "
        "were measured by the project when the targets were set, in the setting of the benchmark "
        "named (the same models and batches, one thread), as the anchor's figure over plain "
        "PyTorch's (for import, the seconds it adds). The method of every figure measured now is "
        "the benchmark's own, in its section below; each run measures the anchors again in the "
        "same interleaved rounds as faccel, and those figures, not the references, are the ones to "
        "compare faccel with. The table is `GOALS` in `benchmarks/common.py`.",
        "",
        "| benchmark: what is compared | faccel target | Accelerate (reference) | Fabric (reference) |",
        "|---|---|---|---|",
    ]
    for kind, figures in GOALS.items():
        row = Row(
            case="",
            subject=FACCEL,
            value=0.0,
            unit="s",
            compare="difference" if kind == "import" else "ratio",
        )
        cells = [
            _bound(row, figures[name]) if name in figures else "" for name in (FACCEL, ACCELERATE, FABRIC)
        ]
        lines.append(f"| {GOAL_MEANINGS.get(kind, kind)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---- the run ----------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Facts that decide how far the figures carry."""
    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [
            line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines() if "model name" in line
        ]
        cpu = names[0] if names else cpu
    return {
        "platform": platform.platform(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in ("torch", "faccel", "accelerate", "lightning")},
    }


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run_one(name: str, *, quick: bool) -> dict[str, Any]:
    """Import ``bench_NAME`` and run it; the result record (rows, or the error)."""
    started = time.perf_counter()
    record: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "clock": os.environ.get("FACCEL_BENCH_CLOCK", "wall"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "load_before": _load(),
    }
    record["rows"] = []
    try:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        record["title"] = (module.__doc__ or name).strip().splitlines()[0]
        # What it measured, kept with the figures: a later change of method must not relabel them.
        record["about"] = _about(module.__doc__ or "")
        # A module whose optional dependency is missing says so (``unavailable() -> reason | None``).
        unavailable = getattr(module, "unavailable", None)
        reason = unavailable() if callable(unavailable) else None
        if reason:
            record["skipped"] = reason
        elif callable(getattr(module, "run", None)):
            record["rows"] = [attrs.asdict(coerce(row, name)) for row in module.run(quick)]
        elif quick:
            record["skipped"] = "a script without run(quick); included in full runs only (its own rounds)"
        else:
            record["output"] = _script_output(name)
    except Exception:
        record["error"] = traceback.format_exc()
    record["seconds"] = round(time.perf_counter() - started, 1)
    record["load_after"] = _load()
    return record


def _script_output(name: str) -> str:
    """What a module without ``run()`` prints when run as a script: shown as it is."""
    done = subprocess.run(
        [sys.executable, str(HERE / f"bench_{name}.py")],
        capture_output=True,
        text=True,
        check=False,
        cwd=ROOT,
    )
    if done.returncode != 0:
        msg = f"bench_{name}.py exited with {done.returncode}:\n{done.stderr[-3000:]}"
        raise RuntimeError(msg)
    return done.stdout


def _rows(record: Mapping[str, Any]) -> list[Row]:
    return [Row(**row) for row in record.get("rows", [])]


def _about(doc: str) -> str:
    """A bench module's docstring after its title line: what it measures, against what."""
    return "\n".join(doc.strip().splitlines()[1:]).strip()


def render_markdown(results: Mapping[str, Any]) -> str:
    """docs/benchmarks.md from the merged results."""
    benches: Mapping[str, Any] = results["benchmarks"]
    info = results["machine"]
    versions = ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v)
    all_rows = [row for record in benches.values() for row in _rows(record)]
    modes = {record["mode"] for record in benches.values()}
    lines = [
        "# Benchmarks",
        "",
        "<!-- generated by benchmarks/run.py; edit that, not this file -->",
        "",
    ]
    if "quick" in modes:
        lines += [
            "> **Quick, noisy run.** Some figures below come from `--quick` (few rounds) on a shared "
            "machine with other jobs running; they show that the benchmarks work, not what faccel "
            "costs. The full run, on a quiet machine, replaces them.",
            "",
        ]
    if results.get("note"):
        lines += [f"> Note: {results['note']}", ""]
    lines += [
        "Each benchmark runs plain PyTorch, faccel, Accelerate and Lightning Fabric in interleaved "
        "rounds (the order rotates every round, after a warm-up), one thread, denormals "
        "flushed. Each round gives one paired comparison with the baseline (a ratio, or for "
        "import time a difference); the tables show the median of those and their range. "
        "Targets, and the anchors' reference figures in parentheses, are explained under "
        "[Targets and reference figures](#targets-and-reference-figures).",
        "",
        "Run them with `python benchmarks/run.py` (add `--quick` for a check of about four minutes, "
        "`--only NAME` for one benchmark); the anchors come from the `bench` extra.",
        "",
        f"Machine: {info['cpu']}, {info['cpus']} CPUs, {info['platform']}; Python {info['python']}, "
        f"{versions}.",
        "",
        "## Summary",
        "",
        summary_table(all_rows),
        "",
        goals_section(),
        "",
    ]
    for name, record in benches.items():
        load = f"load average {record.get('load_before')} -> {record.get('load_after')}"
        lines += [
            f"## {name}: {record.get('title', name)}",
            "",
            f"{record['mode']} run, {record.get('clock', 'wall')} clock, {record['date']}, "
            f"{record['seconds']} s, {load}.",
            "",
        ]
        about = record.get("about", "")
        if about:
            lines += [
                "<details><summary>What is measured</summary>",
                "",
                "```text",
                about,
                "```",
                "",
                "</details>",
                "",
            ]
        if record.get("error"):
            last = record["error"].strip().splitlines()[-1]
            lines += [f"Failed: `{last}`", ""]
        if record.get("rows"):
            lines += [markdown_table(_rows(record)), ""]
        if record.get("output"):
            lines += ["Its own report (the module has no `run()` yet, so no summary rows):", ""]
            lines += ["```text", record["output"].strip(), "```", ""]
        if record.get("skipped"):
            lines += [f"Not run: {record['skipped']}.", ""]
    pending = [name for name in PLANNED if name not in benches]
    if pending:
        lines += ["## Pending", ""]
        lines += [f"- **{name}**: {PLANNED[name]}" for name in pending]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (1 when a benchmark failed)."""
    registry = discover()
    parser = argparse.ArgumentParser(prog="python benchmarks/run.py", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few rounds: a check, not a measurement")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these: {', '.join(registry)}")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--no-write", action="store_true", help="print only; leave the files alone")
    parser.add_argument(
        "--render", action="store_true", help="rewrite docs/benchmarks.md from results.json; run nothing"
    )
    parser.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: what a user waits for (default); cpu: this process's CPU time, steadier on a "
        "machine shared with other jobs (DDP keeps the wall clock)",
    )
    parser.add_argument("--note", default="", help="a line for docs/benchmarks.md (e.g. the machine's load)")
    args = parser.parse_args(argv)

    if args.list:
        for name, path in registry.items():
            print(f"{name:<14} {path.relative_to(ROOT)}")
        for name in PLANNED:
            if name not in registry:
                print(f"{name:<14} pending: {PLANNED[name]}")
        return 0
    if args.render:
        DOC.write_text(render_markdown(json.loads(RESULTS.read_text())))
        print(f"wrote {DOC.relative_to(ROOT)} from {RESULTS.relative_to(ROOT)}")
        return 0
    unknown = sorted(set(args.only or ()) - set(registry))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; known: {', '.join(registry)}")
    selected = [name for name in registry if not args.only or name in args.only]

    # Hygiene for every module: one thread (children inherit it through the environment)
    # and denormals flushed, so a slowly shrinking value cannot slow a subject down.
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["FACCEL_BENCH_CLOCK"] = args.clock
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)

    started = time.perf_counter()
    fresh: dict[str, Any] = {}
    for name in selected:
        print(f"== {name} ...", flush=True)
        record = run_one(name, quick=args.quick)
        fresh[name] = record
        print(f"== {name}: {record.get('title', '')} ({record['mode']}, {record['seconds']} s)")
        if record["rows"]:
            print(text_table(_rows(record)))
        if record.get("output"):
            print(record["output"].rstrip())
        if record.get("skipped"):
            print(f"  not run: {record['skipped']}")
        if record.get("error"):
            print(record["error"], file=sys.stderr)
        print(flush=True)
    total = time.perf_counter() - started
    print(f"total {total:.0f} s")

    if not args.no_write:
        old = json.loads(RESULTS.read_text()) if RESULTS.exists() and args.only else {"benchmarks": {}}
        merged = {**old.get("benchmarks", {}), **fresh}
        results = {
            "machine": machine(),
            "note": args.note or old.get("note", ""),
            "benchmarks": {name: merged[name] for name in registry if name in merged},
        }
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
        DOC.write_text(render_markdown(results))
        print(f"wrote {RESULTS.relative_to(ROOT)} and {DOC.relative_to(ROOT)}")
    return 1 if any(record.get("error") for record in fresh.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
