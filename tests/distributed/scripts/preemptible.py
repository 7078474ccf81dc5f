"""A resumable loop for torchrun: stops on a signal, or dies, and resumes bitwise (docs/preemption.md).

torchrun --standalone --nproc-per-node 2 [--max-restarts 1] preemptible.py ROOT OUT MODE

It restores the latest checkpoint under ROOT if there is one, trains to step
STEPS, checkpointing every EVERY steps, and rank 0 writes the final weights'
bytes (hex) to OUT. It prints ``rank R step S`` after each step (the test
sends its signals after reading ``step 7``). MODE:

* ``plain``: train on.
* ``signal``: a ``stop_signal``; at a SIGTERM on any rank, every rank
  checkpoints at the same step and exits 0. Rank 1 then sends itself
  SIGTERMs during the save: they must change nothing.
* ``kill``: on the first attempt, rank 1 SIGKILLs itself after step 13.
* ``kill-background``: as ``kill``, with ``blocking=False`` checkpoints, and
  the kill comes while the step-12 checkpoint may still be writing.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import threading
from pathlib import Path

import attrs
import torch
from torch import nn

import faccel

STEPS = 30
EVERY = 4


def main(root: Path, out: Path, mode: str) -> None:
    dist = faccel.detect(timeout=datetime.timedelta(seconds=float(os.environ.get("TEST_TIMEOUT", "30"))))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    if faccel.latest_checkpoint(root) is not None:
        state = faccel.restore(dist, state, root)
        _say(f"rank {dist.rank} restored step {state.step}")
    stop = faccel.stop_signal(dist) if mode == "signal" else None
    _say(f"rank {dist.rank} pid {os.getpid()}")
    blocking = mode != "kill-background"
    while state.step < STEPS:
        step = state.step
        # The batch is a function of the step and rank: a resumed run sees the same data.
        data = torch.Generator().manual_seed(1000 * step + dist.rank)
        inputs = torch.randn(16, 4, generator=data)
        optimizer.zero_grad()
        loss = (state.model(inputs) - inputs.sum(1, keepdim=True)).pow(2).mean()
        faccel.backward(dist, loss)
        optimizer.step()
        state = attrs.evolve(state, step=step + 1)
        _say(f"rank {dist.rank} step {state.step}")
        if mode.startswith("kill") and dist.attempt == 0 and dist.rank == 1 and state.step == 13:
            os.kill(os.getpid(), signal.SIGKILL)
        if stop is not None and faccel.any_rank(dist, stop.received):
            storm = threading.Event()
            sender = threading.Thread(target=_signals_until, args=(storm,), daemon=True)
            if dist.rank == 1:  # a second (and third ...) signal while the checkpoint is written
                sender.start()
            faccel.checkpoint(dist, state, root)
            storm.set()
            if sender.is_alive():
                # Joined before shutdown puts the previous handlers back: a SIGTERM the thread
                # was about to send would otherwise meet the default action and kill this rank.
                sender.join()
            _say(f"rank {dist.rank} stopped at step {state.step}")
            faccel.shutdown(dist)
            return
        if state.step % EVERY == 0:
            faccel.checkpoint(dist, state, root, blocking=blocking)
    if dist.is_main_process:
        weights = faccel.unwrap_model(state.model).state_dict()
        out.write_text(
            "\n".join(
                f"{name} {t.contiguous().view(-1).view(torch.uint8).numpy().tobytes().hex()}"
                for name, t in weights.items()
            )
        )
    faccel.shutdown(dist)


def _say(line: str) -> None:
    """One line in one write(): the two workers share torchrun's pipe, and torchrun runs them with
    ``python -u``, under which print() writes the text and its newline apart, so two ranks' lines
    could merge ("rank 0 step 7rank 1 step 7") and the test miss the line it waits for. A write of
    under PIPE_BUF bytes to a pipe is atomic."""
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def _signals_until(done: threading.Event) -> None:
    while not done.is_set():
        os.kill(os.getpid(), signal.SIGTERM)
        done.wait(0.001)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
