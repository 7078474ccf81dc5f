"""The benchmark runner's own logic: pairing, interleaving, the module interface, the report."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import statistics
from pathlib import Path

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import common, run

_figures = st.lists(st.floats(0.1, 10.0), min_size=1, max_size=30)


@given(_figures, st.data())
def test_rows_report_the_median_and_range_of_the_paired_comparisons(base: list[float], data) -> None:  # type: ignore[no-untyped-def]
    other = data.draw(st.lists(st.floats(0.1, 10.0), min_size=len(base), max_size=len(base)))
    ratio, difference = (
        common.rows(
            "case", {common.PLAIN: base, common.FACCEL: other}, baseline=common.PLAIN, unit="s", compare=c
        )
        for c in ("ratio", "difference")
    )
    pairs = [o / b for o, b in zip(other, base, strict=True)]
    plain, mine = ratio
    assert (plain.subject, plain.baseline, plain.median) == (common.PLAIN, None, None)
    assert mine.value == statistics.median(other)
    assert (mine.median, mine.low, mine.high) == (statistics.median(pairs), min(pairs), max(pairs))
    assert difference[1].median == statistics.median([o - b for o, b in zip(other, base, strict=True)])


def test_targets_and_anchor_figures_come_from_the_goals_table() -> None:
    samples = {common.PLAIN: [1.0, 1.0], common.FACCEL: [1.01, 1.05], common.ACCELERATE: [1.3, 1.4]}
    _, mine, anchor = common.rows("c", samples, baseline=common.PLAIN, unit="s", goals="step")
    assert (mine.target, mine.met) == (1.03, True)  # median of 1.01 and 1.05
    assert (anchor.target, anchor.reference, anchor.met) == (None, 1.34, None)


def test_interleave_rotates_the_order_and_drops_the_warmup() -> None:
    calls: list[str] = []

    def subject(name: str):  # type: ignore[no-untyped-def]
        return lambda: calls.append(name) or float(len(calls))

    samples = common.interleave({n: subject(n) for n in "abc"}, rounds=3, warmup=1)
    assert "".join(calls) == "abc" + "bca" + "cab" + "abc"
    assert {name: len(figures) for name, figures in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert samples["a"] == [6.0, 8.0, 10.0]  # positions of a's calls after the warm-up round


def test_modules_may_return_rows_dicts_or_dataclasses() -> None:
    @dataclasses.dataclass
    class Theirs:
        case: str
        subject: str
        value: float
        unit: str
        extra: str = "ignored"

    row = common.Row(case="c", subject="faccel", value=1.0, unit="s")
    assert run.coerce(row, "x").bench == "x"
    assert run.coerce({"case": "c", "subject": "disk", "value": 2.0, "unit": "GB/s"}, "y").subject == "disk"
    assert run.coerce(Theirs("c", "faccel", 3.0, "s"), "z") == common.Row(
        case="c", subject="faccel", value=3.0, unit="s", bench="z"
    )
    with pytest.raises(TypeError, match="expected Row"):
        run.coerce(("c", "faccel"), "w")


def test_the_registry_finds_the_modules_in_display_order() -> None:
    names = list(run.discover())
    assert {"step", "data", "import", "ddp"} <= set(names)
    assert names.index("step") < names.index("data") < names.index("import") < names.index("ddp")


def _top_level_names(module: str) -> set[str]:
    """The names a faccel module defines or imports at its top level, read from its source (no import)."""
    base = Path(run.ROOT, *module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_name_a_benchmark_imports_from_faccel_exists() -> None:
    """Benchmarks import some private helpers inside functions, where a rename only shows in a
    full run (one did: bench_save_model_memory after the storage seam): each must still resolve."""
    missing = []
    for path in sorted(Path(run.HERE).glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "faccel":
                module = node.module or ""
                base = Path(run.ROOT, *module.split("."))
                if base.is_dir() and not (base / "__init__.py").exists():
                    missing.append(f"{path.name}: {module} is not a package")
                    continue
                defined = _top_level_names(module)
                names = [alias.name for alias in node.names]
                missing += [f"{path.name}: {module}.{n}" for n in names if n not in defined and n != "*"]
    assert missing == []


def test_the_report_has_a_summary_the_sections_and_what_is_pending() -> None:
    samples = {common.PLAIN: [2.0, 2.2], common.FACCEL: [2.1, 2.2], common.FABRIC: [2.4, 2.6]}
    made = common.rows("small MLP", samples, baseline=common.PLAIN, unit="us/step", goals="step")
    rows = [attrs.asdict(run.coerce(r, "step")) for r in made]
    results = {
        "machine": {
            "cpu": "cpu",
            "cpus": 2,
            "platform": "linux",
            "python": "3.11",
            "versions": {"torch": "2"},
        },
        "note": "shared machine",
        "benchmarks": {
            "step": {
                "title": "Steps.",
                "mode": "quick",
                "clock": "wall",
                "date": "d",
                "seconds": 1.0,
                "rows": rows,
            },
            "import": {
                "title": "Import.",
                "mode": "quick",
                "date": "d",
                "seconds": 1.0,
                "rows": [],
                "error": "E\nBoom",
            },
        },
    }
    text = run.render_markdown(results)
    assert "**Quick, noisy run.**" in text and "Note: shared machine" in text
    assert "| step | small MLP | 1.025 | 1.000 to 1.050 | 1.03 | met | not run | 1.191 (1.10) |" in text
    assert "## step: Steps." in text and "Failed: `Boom`" in text
    assert all(f"- **{name}**" in text for name in run.PLANNED if name not in results["benchmarks"])
    table = run.text_table(
        [run.coerce(r, "step") for r in common.rows("m", samples, baseline=common.PLAIN, unit="s")]
    )
    assert "faccel" in table and "1.025" in table


def test_the_summary_keeps_two_benchmarks_whose_cases_share_their_words() -> None:
    """observe and step both time "small MLP ...": each keeps its own summary row (the observe row
    once hid the step row, with the step's anchors printed beside the meter's figure)."""
    samples = {common.PLAIN: [2.0, 2.2], common.FACCEL: [2.1, 2.2]}
    step = common.rows("small MLP", samples, baseline=common.PLAIN, unit="us/step")
    metered = {"faccel, no meter": [2.0, 2.0], common.FACCEL: [2.2, 2.2]}
    observe = common.rows("small MLP", metered, baseline="faccel, no meter", unit="us/step")
    table = run.summary_table(
        [run.coerce(r, "step") for r in step] + [run.coerce(r, "observe") for r in observe]
    )
    assert "| step | small MLP | 1.025 |" in table and "| observe | small MLP | 1.100 |" in table


def test_the_committed_report_is_rendered_from_the_committed_results() -> None:
    import json

    # docs/benchmarks.md is generated: its targets, reference figures and labels come from
    # results.json and the GOALS table, and it cites nothing outside the repository.
    text = run.render_markdown(json.loads(run.RESULTS.read_text()))
    assert run.DOC.read_text() == text
    assert "DESIGN" not in text and "DESIGN" not in run.RESULTS.read_text()
    section = text.split("## Targets and reference figures")[1].split("\n## ")[0]
    for kind, figures in common.GOALS.items():
        assert run.GOAL_MEANINGS[kind] in section
        assert len(figures) >= 1


def test_the_activation_checkpointing_count_is_the_by_hand_one_and_a_tenth_of_plain() -> None:
    """The deterministic figure of benchmarks/bench_activation_checkpointing.py (docs/large-models.md)."""
    from benchmarks import bench_activation_checkpointing as bench

    kept = {subject: bench.activations_kept(subject) for subject in bench.SUBJECTS}
    assert kept[common.FACCEL] == kept[bench.BY_HAND] < kept[common.PLAIN] / 10, kept


def test_the_deepspeed_benchmark_says_why_it_cannot_run_without_deepspeed() -> None:
    from benchmarks import bench_deepspeed

    installed = importlib.util.find_spec("deepspeed") is not None
    assert (bench_deepspeed.unavailable() is None) == installed
    if not installed:  # CI: run.py records it as skipped, and run() gives no rows
        assert "pip install 'faccel[deepspeed]'" in (bench_deepspeed.unavailable() or "")
        assert bench_deepspeed.run(quick=True) == []


@pytest.mark.deepspeed
@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_the_deepspeed_benchmark_compares_a_zero2_step_and_a_checkpoint_with_deepspeed_by_hand() -> None:
    # Two gloo processes, then one, quick rounds (about 45 s here); the figures themselves are not checked.
    from benchmarks import bench_deepspeed

    found = bench_deepspeed.run(quick=True)
    assert [(row.subject, row.baseline) for row in found] == [
        ("raw DeepSpeed", None),
        ("faccel", "raw DeepSpeed"),
    ] * 3
    assert found[1].target == common.GOALS["deepspeed_step"]["faccel"]
    assert all(row.value > 0 and row.rounds > 0 for row in found)
