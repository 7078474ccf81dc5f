"""The long proof of exact mode: the tree law with many examples, and the training at 1, 2, 4 and 8 ranks.

    PYTHONPATH=. python scripts/prove_exact.py [--examples N] [--no-training]

1. The tree law (tests/test_exact_tree.py runs it with 60 examples): for any atom count up to
   2**10 and any data-parallel size dividing it, the ranks' combination along the exchange's
   plans is, on every rank, bitwise the one-process tree. Default 2000 examples.
2. examples/exact_any_scale.py's run (a small transformer with dropout, AdamW, 20 steps over 2
   epochs, atoms=8) on real gloo processes: straight at 1, 2, 4 and 8 processes, and resized
   along 8 -> 2 -> 1, 1 -> 8 -> 4 and 4 -> 8 -> 2 (stops at steps 7 and 14, mid-epoch): every
   final digest of the weights and AdamW state and every loss equal, bit for bit
   (tests/distributed/test_exact.py runs sizes 1, 2, 4 and the chain 2 -> 4 -> 1).

Budget, on 2 CPU cores: the training took 25 s at load ~1 (all 7 runs equal, 2026-12-03) and
takes minutes under load (8 processes share the cores; each run's harness timeout is 600 s);
the tree law's examples cost 0.06 s each at load ~1 and up to 0.5 s under load (up to 1024
simulated ranks each): 2000 examples, 2 to 15 minutes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from tests import test_exact_tree
from tests.distributed import exact_workers, harness
from tests.strategies import atom_layouts

CHAINS = ((8, 2, 1), (1, 8, 4), (4, 8, 2))


def tree(examples: int) -> None:
    proof = settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))(
        given(atom_layouts(max_log_atoms=10))(test_exact_tree.tree_law)
    )
    start = time.perf_counter()
    proof()
    print(f"tree law: {examples} examples passed in {time.perf_counter() - start:.0f} s", flush=True)


def training() -> bool:
    start = time.perf_counter()
    runs = {size: harness.run(exact_workers.train, world_size=size, timeout=600) for size in (1, 2, 4, 8)}
    reference = runs[1][0]
    ok = True
    for size, results in runs.items():
        same = all(r["digest"] == reference["digest"] and r["losses"] == reference["losses"] for r in results)
        print(f"{size} process(es): {results[0]['digest'][:16]} equal on every rank and to 1: {same}")
        ok &= same
    for chain in CHAINS:
        with tempfile.TemporaryDirectory() as folder:
            root = str(Path(folder) / "ckpt")
            losses: list[float] = []
            result: dict = {}
            for stop, size in zip((7, 14, 20), chain, strict=True):
                result = harness.run(
                    exact_workers.train,
                    world_size=size,
                    timeout=600,
                    root=root,
                    stop_at=stop,
                    resume=stop > 7,
                )[0]
                losses += result["losses"]
        same = result["digest"] == reference["digest"] and losses == reference["losses"]
        print(f"resized {' -> '.join(map(str, chain))}: {result['digest'][:16]} equal to 1: {same}")
        ok &= same
    print(f"training: {'all equal' if ok else 'DIFFERENCES'} in {time.perf_counter() - start:.0f} s")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=2000, help="examples of the tree law")
    parser.add_argument("--no-training", action="store_true", help="the tree law only")
    args = parser.parse_args()
    tree(args.examples)
    return 0 if args.no_training or training() else 1


if __name__ == "__main__":
    sys.exit(main())
