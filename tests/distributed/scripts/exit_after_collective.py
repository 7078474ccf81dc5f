"""A job whose last act is a collective on tensors it drops at once, to prove that every rank exits.

    torchrun --standalone --nproc-per-node 2 exit_after_collective.py OUT [shutdown]

An FSDP2 model (its modules keep the process group alive past ``destroy_process_group``), a
step, then an ``all_gather`` of tensors that go out of scope as ``main`` returns. gloo's worker
thread may still be freeing them when Python finalizes: that aborted the process ("terminate
called without an active exception", SIGABRT) in 3 of 20 such jobs on a loaded machine before
faccel let the workers settle (faccel/_dist/_settle.py). With ``shutdown`` the script calls
``faccel.shutdown`` last; without it, faccel stops the group at exit. Each rank writes
``exited-RANK`` as its last act in ``main``; the job's exit status tells the rest.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import faccel


def main(out: Path, shutdown: bool) -> None:
    dist = faccel.detect(strategy="fsdp")
    torch.manual_seed(0)
    model = faccel.prepare(dist, torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)]))
    faccel.backward(dist, model(torch.randn(4, 32)).square().mean())
    extra = torch.tensor([float(dist.rank), 2.0], dtype=torch.float64)
    gathered = [torch.zeros_like(extra) for _ in range(dist.world_size)]
    torch.distributed.all_gather(gathered, extra)
    if shutdown:
        faccel.shutdown(dist)
    (out / f"exited-{dist.rank}").write_text(str([float(g[0]) for g in gathered]))


if __name__ == "__main__":
    main(Path(sys.argv[1]), "shutdown" in sys.argv[2:])
