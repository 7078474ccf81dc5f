"""One rank fails while the other waits in a collective: the whole job must end quickly.

torchrun --standalone --nproc-per-node 2 tests/distributed/scripts/rank_fails.py raise
torchrun --standalone --nproc-per-node 2 tests/distributed/scripts/rank_fails.py stall

``raise``: rank 1 raises. Its process dies, gloo's connection to it closes, and
torchrun's agent, seeing a failed worker, stops the others and exits non-zero.
``stall``: rank 1 neither raises nor joins (a deadlock, a stuck file system).
Rank 0's collective gives up after the process-group timeout set with
``faccel.detect(timeout=...)`` and raises; torchrun then stops rank 1.
"""

from __future__ import annotations

import datetime
import sys
import time

import torch

import faccel


def main(mode: str) -> None:
    dist = faccel.detect(timeout=datetime.timedelta(seconds=5))
    if dist.rank == 1:
        time.sleep(0.5)  # rank 0 is inside the collective by now
        if mode == "raise":
            msg = "rank 1 failed on purpose: the evaluation file is missing"
            raise RuntimeError(msg)
        time.sleep(600)  # stalls: never joins the collective
    faccel.gather(dist, torch.ones(1))
    print("rank 0 left the collective, which it never should", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "raise")
