"""What every benchmark module shares: the Row it reports and interleaved, paired timing.

A benchmark module ``benchmarks/bench_NAME.py`` exposes ``run(quick: bool) -> list[Row]``
(see README.md). The helpers here keep the measurement hygiene the same everywhere:

* subjects (plain PyTorch, faccel, the anchors) run in *interleaved rounds*, the order
  rotating every round, so a slow period of a shared machine hits them all alike;
* each round gives one paired comparison (``ratio`` subject / baseline, or ``difference``),
  and a row reports the *median* of those pairs with their min and max;
* a warm-up round runs first and is thrown away.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

PLAIN = "plain PyTorch"
FACCEL = "faccel"
ACCELERATE = "Accelerate"
FABRIC = "Fabric"

# Per kind of comparison: faccel's target (a bound on the median paired comparison) and
# the anchors' reference figures, the project's own earlier measurements of them.
# docs/benchmarks.md ("Targets and reference figures", rendered from this table by
# run.py) states what each figure is and how it was measured.
GOALS: Mapping[str, Mapping[str, float]] = {
    "step": {FACCEL: 1.03, ACCELERATE: 1.34, FABRIC: 1.10},
    "accumulation": {FACCEL: 1.03, ACCELERATE: 1.38, FABRIC: 1.15},
    "batch_iteration": {FACCEL: 1.02, ACCELERATE: 1.07, FABRIC: 1.09},
    "import": {FACCEL: 0.03, ACCELERATE: 0.10, FABRIC: 2.1},
    "checkpoint": {FACCEL: 1.0, ACCELERATE: 1.01, FABRIC: 2.42},
    "restore": {FACCEL: 1.0},
    "ddp_step": {FACCEL: 1.02},
    "deepspeed_step": {FACCEL: 1.02},
    "parallel_step": {FACCEL: 1.03},
    "exact_step": {FACCEL: 1.3},
    "eval_forward": {FACCEL: 1.05},
    "moe": {FACCEL: 1.05},
    "moe_memory": {FACCEL: 1.0},
    "observe_step": {FACCEL: 1.01},
    "ft_step": {FACCEL: 1.05},
}


@attrs.frozen(kw_only=True)
class Row:
    """One subject's figure in one benchmark case, compared with that case's baseline.

    Attributes:
        case: What is measured, e.g. ``"small MLP 32-64-64-1, batch 32"``.
        subject: Who is measured: ``plain PyTorch``, ``faccel``, ``Accelerate``, ``Fabric``,
            ``disk``...
        value: The median of the subject's own figures, in ``unit``.
        unit: ``"us/step"``, ``"ms/epoch"``, ``"s"``, ``"GB/s"``...
        baseline: The subject this row is compared with; None for a figure that stands
            alone (a disk's bandwidth, the baseline itself).
        compare: ``"ratio"`` (subject / baseline, per round) or ``"difference"``
            (subject - baseline, per round, in ``unit``).
        median: The median paired comparison over the rounds.
        low: The smallest paired comparison.
        high: The largest paired comparison.
        target: faccel's bound on ``median`` (met when ``median <= target``).
        reference: The anchors' reference figure for this subject (:data:`GOALS`).
        rounds: Rounds measured (after the warm-up).
        note: Anything a reader needs to read the figure right.
        bench: The module's name (``step`` for ``bench_step.py``); run.py fills it in.
    """

    case: str
    subject: str
    value: float
    unit: str
    baseline: str | None = None
    compare: str = "ratio"
    median: float | None = None
    low: float | None = None
    high: float | None = None
    target: float | None = None
    reference: float | None = None
    rounds: int = 0
    note: str = ""
    bench: str = ""

    @property
    def met(self) -> bool | None:
        """Whether ``median`` is within ``target`` (None without a target)."""
        if self.target is None or self.median is None:
            return None
        return self.median <= self.target


def interleave(
    subjects: Mapping[str, Callable[[], float]], *, rounds: int, warmup: int = 1
) -> dict[str, list[float]]:
    """Call every subject once per round, rotating the order; return each one's figures.

    Each callable measures one block (say, 200 training steps) and returns its figure
    (say, seconds per step). Garbage is collected before every block so one subject's
    garbage is not paid for by the next.
    """
    names = list(subjects)
    samples: dict[str, list[float]] = {name: [] for name in names}
    # torch and the anchors leave ~300k objects behind: a full collection scans them all
    # (~0.2 s). Frozen, they are skipped, and the collection before each block is cheap.
    gc.collect()
    gc.freeze()
    for index in range(warmup + rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            figure = subjects[name]()
            if index >= warmup:
                samples[name].append(figure)
    return samples


def clock() -> Callable[[], float]:
    """The clock that in-process benchmarks read: ``run.py --clock`` chooses it.

    ``wall`` (the default) is what a user waits for. ``cpu`` is this process's CPU
    time: on a machine shared with other jobs it leaves out the time the process sat
    descheduled, which wall-clock pairs cannot tell from overhead. For one thread on
    an idle machine the two agree. Benchmarks that wait on other processes (DDP,
    fsync) keep the wall clock.
    """
    return time.process_time if cpu_clock() else time.perf_counter


def cpu_clock() -> bool:
    """Whether ``run.py --clock cpu`` asked for CPU time rather than wall-clock time."""
    return os.environ.get("FACCEL_BENCH_CLOCK") == "cpu"


def per_call(fn: Callable[[], object], calls: int, *, now: Callable[[], float] | None = None) -> float:
    """Seconds per call of ``fn``, over ``calls`` calls in a row, on ``now`` or :func:`clock`."""
    now = now or clock()
    start = now()
    for _ in range(calls):
        fn()
    return (now() - start) / calls


def paired(figures: Sequence[float], base: Sequence[float], compare: str) -> list[float]:
    """Round-by-round comparison of a subject's figures with the baseline's."""
    if compare == "ratio":
        return [f / b for f, b in zip(figures, base, strict=True)]
    if compare == "difference":
        return [f - b for f, b in zip(figures, base, strict=True)]
    msg = f"compare must be 'ratio' or 'difference', got {compare!r}"
    raise ValueError(msg)


def rows(
    case: str,
    samples: Mapping[str, Sequence[float]],
    *,
    baseline: str,
    unit: str,
    scale: float = 1.0,
    compare: str = "ratio",
    goals: str | None = None,
    notes: Mapping[str, str] | None = None,
) -> list[Row]:
    """Rows for every subject of ``samples`` (the baseline first), compared with ``baseline``.

    Args:
        case: What is measured.
        samples: Subject -> figures per round, as :func:`interleave` returns them.
        baseline: The subject the others are compared with.
        unit: The unit of the figures after ``scale``.
        scale: Multiplies the figures (``1e6`` turns seconds into microseconds).
        compare: ``"ratio"`` or ``"difference"``.
        goals: Key of :data:`GOALS` whose target and anchor figures apply.
        notes: Subject -> a note for its row.
    """
    figures_of = GOALS.get(goals, {}) if goals else {}
    base = [x * scale for x in samples[baseline]]
    ordered = [baseline, *(name for name in samples if name != baseline)]
    out = []
    for name in ordered:
        figures = [x * scale for x in samples[name]]
        pairs = paired(figures, base, compare)
        out.append(
            Row(
                case=case,
                subject=name,
                value=statistics.median(figures),
                unit=unit,
                baseline=None if name == baseline else baseline,
                compare=compare,
                median=None if name == baseline else statistics.median(pairs),
                low=None if name == baseline else min(pairs),
                high=None if name == baseline else max(pairs),
                target=figures_of.get(name) if name == FACCEL else None,
                reference=figures_of.get(name) if name != FACCEL else None,
                rounds=len(figures),
                note=(notes or {}).get(name, ""),
            )
        )
    return out


def anchors() -> dict[str, bool]:
    """Which anchors are installed (``pip install -c constraints.txt -e '.[bench]'``)."""
    found = {}
    for subject, module in ((ACCELERATE, "accelerate"), (FABRIC, "lightning.fabric")):
        try:
            __import__(module)
        except ImportError:
            found[subject] = False
        else:
            found[subject] = True
    return found


def rank_env(rank: int, port: int, world_size: int = 2) -> dict[str, str]:
    """The torchrun-like environment of ``rank``, meeting at the parent's store on ``port``."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        # The parent hosts the store: every rank connects, as to torchrun's agent.
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def run_ranks(
    target: Callable[..., None], payload: object, *, what: str, world_size: int = 2, timeout: float = 600
) -> object:
    """Run ``target(rank, port, payload, out)`` on ``world_size`` spawned processes; return ``out``'s JSON.

    A rank still running ``timeout`` seconds after the start is killed (and the call fails).

    The parent hosts the rendezvous store on a port the OS picks, as torchrun's agent
    does; the ranks connect to it, and one of them writes its figures as JSON to ``out``.
    """
    import json
    import multiprocessing as mp
    import tempfile
    from datetime import timedelta
    from pathlib import Path

    import torch.distributed as tdist

    store = tdist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(minutes=5)
    )
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "samples.json")
        procs = [
            ctx.Process(target=target, args=(rank, store.port, payload, out)) for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        killed = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for rank in killed:
            procs[rank].kill()
            procs[rank].join()
        failed = [rank for rank, proc in enumerate(procs) if proc.exitcode != 0]
        if failed:
            late = f"; ranks {killed} killed, still running after {timeout:g} s" if killed else ""
            msg = f"{what}: ranks {failed} failed (exit codes {[p.exitcode for p in procs]}){late}"
            raise RuntimeError(msg)
        result = json.loads(Path(out).read_text())
    del store
    return result


def rss_bytes() -> int:
    """This process's resident set size now (``/proc/self/statm``), in bytes."""
    with open("/proc/self/statm", "rb") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Peak:
    """The peak resident set size while the ``with`` block runs, sampled by a thread every 2 ms."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes())
            time.sleep(0.002)

    def __enter__(self) -> Peak:
        self.peak = rss_bytes()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())


def gpt2_config(
    width: int, blocks: int, vocab: int, *, heads: int = 8, positions: int = 256, dropout: float | None = 0.0
) -> Any:
    """A GPT-2 config built locally (no hub) for the model-size benchmarks; ``dropout=None``: GPT-2's own."""
    import transformers

    drops = {} if dropout is None else {"resid_pdrop": dropout, "embd_pdrop": dropout, "attn_pdrop": dropout}
    return transformers.GPT2Config(
        n_embd=width,
        n_layer=blocks,
        n_head=heads,
        vocab_size=vocab,
        n_positions=positions,
        bos_token_id=0,
        eos_token_id=0,
        **drops,
    )
