"""Two processes started by hand (no torchrun agent): rank 0 hosts the rendezvous store, then dies.

RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python store_host_dies.py ROOT

Both ranks prepare and meet once; rank 0 then exits at once (its store goes with it), and rank 1
calls ``checkpoint``, printing the error it gets (a raw DistNetworkError).
"""

from __future__ import annotations

import datetime
import os
import sys

import torch

import faccel


def main(root: str) -> None:
    dist = faccel.detect(timeout=datetime.timedelta(seconds=20))
    model = faccel.prepare(dist, torch.nn.Linear(2, 1))
    faccel.wait_for_everyone(dist)
    if dist.rank == 0:
        os._exit(0)  # the store's host is gone, without a word
    state = faccel.TrainState.create(model=model, optimizer=None)
    try:
        faccel.checkpoint(dist, state, root)
    except Exception as error:  # the point is which error the survivor sees
        print(f"rank 1: {type(error).__name__}: {error}", flush=True)
        os._exit(0)
    print("rank 1: no error", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
