"""A torchrun script that ends without ``faccel.shutdown``: its process group is stopped at exit.

torchrun --standalone --nproc-per-node 2 tests/distributed/scripts/no_shutdown.py

A handler registered before ``detect`` runs after faccel's (``atexit`` runs
handlers last-in, first-out) and prints whether the group still runs then.
"""

from __future__ import annotations

import atexit
import os
import sys

import torch
import torch.distributed as tdist

import faccel


def _say(line: str) -> None:
    # One write() a line: both workers share torchrun's pipe, and under torchrun's `python -u`
    # print() writes the newline apart, so two ranks' lines could merge.
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def _report(rank: list[int]) -> None:
    _say(f"rank {rank[0]}: process group running at exit: {tdist.is_initialized()}")


def main() -> None:
    rank: list[int] = []
    atexit.register(_report, rank)
    dist = faccel.detect()
    rank.append(dist.rank)
    model = faccel.prepare(dist, torch.nn.Linear(2, 1))
    faccel.backward(dist, model(torch.ones(4, 2)).mean())
    _say(f"rank {dist.rank}: summed {faccel.reduce(dist, torch.ones(1), op='sum').item()}")


if __name__ == "__main__":
    main()  # no faccel.shutdown(dist): the script just ends
