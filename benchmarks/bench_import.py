"""Import time, as whole processes: ``python -c "import torch, X"`` vs ``python -c "import torch"``.

What a user waits for when a script starts. Each round starts one fresh interpreter
per subject (order rotating); a row reports the median of the per-round differences
from ``import torch`` alone.
"""

from __future__ import annotations

import functools
import os
import resource
import subprocess
import sys
import time

from benchmarks.common import ACCELERATE, FABRIC, FACCEL, PLAIN, Row, anchors, cpu_clock, interleave, rows

STATEMENTS = {
    PLAIN: "import torch",
    FACCEL: "import torch, faccel",
    ACCELERATE: "import torch, accelerate",
    FABRIC: "import torch, lightning.fabric",
}


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _process(statement: str) -> float:
    """Seconds of a fresh interpreter that runs ``statement`` and exits.

    Wall-clock by default; with ``--clock cpu`` the CPU time the child used.
    """
    now = _children_cpu if cpu_clock() else time.perf_counter
    # Bytecode caching on, as in a user's install: without it (PYTHONDONTWRITEBYTECODE,
    # set on some machines) every run compiles faccel from source while torch and the
    # anchors, compiled by pip at install time, do not.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["OMP_NUM_THREADS"] = "1"
    start = now()
    subprocess.run([sys.executable, "-c", statement], check=True, env=env)
    return now() - start


# The same question asked inside one process: the time ``import X`` takes once torch is
# imported. Free of the interpreter's start and exit, which swing by tenths of a second
# on a busy machine, so it shows small differences the whole-process figure cannot.
_INSIDE = (
    "import sys, time, torch; clock = time.{clock}; start = clock(); import {module}; "
    "sys.stdout.write(repr(clock() - start))"
)
MODULES = {FACCEL: "faccel", ACCELERATE: "accelerate", FABRIC: "lightning.fabric"}


def _inside(module: str) -> float:
    """Seconds ``import module`` takes in a fresh interpreter that has imported torch."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    clock = "process_time" if cpu_clock() else "perf_counter"
    statement = _INSIDE.format(clock=clock, module=module)
    done = subprocess.run(
        [sys.executable, "-c", statement], check=True, env=env, capture_output=True, text=True
    )
    return float(done.stdout)


def run(quick: bool) -> list[Row]:
    installed = anchors()
    subjects = {
        name: functools.partial(_process, statement)
        for name, statement in STATEMENTS.items()
        if installed.get(name, True)
    }
    # One interpreter that imports everything warms the file cache for all subjects,
    # for the price of one process rather than a whole warm-up round.
    _process("; ".join(statement for name, statement in STATEMENTS.items() if name in subjects))
    samples = interleave(subjects, rounds=2 if quick else 30, warmup=0)
    whole = rows(
        "fresh interpreter, python -c 'import torch[, X]'",
        samples,
        baseline=PLAIN,
        unit="s",
        compare="difference",
        goals="import",
        notes={PLAIN: "import torch alone", FABRIC: "import lightning.fabric"},
    )
    inside_subjects = {
        name: functools.partial(_inside, MODULES[name]) for name in subjects if name in MODULES
    }
    inside = interleave(inside_subjects, rounds=2 if quick else 30, warmup=0)
    # Against an empty baseline, each figure is its own difference from `import torch`.
    inside[PLAIN] = [0.0] * len(next(iter(inside.values())))
    parts = rows(
        "import X after import torch, timed inside the process",
        inside,
        baseline=PLAIN,
        unit="s",
        compare="difference",
        goals="import",
        notes={PLAIN: "torch already imported", FABRIC: "import lightning.fabric"},
    )
    return whole + parts
