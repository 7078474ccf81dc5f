"""Sharded checkpoints, 2 gloo ranks, FSDP2: faccel's sharded format vs torch.distributed.checkpoint.

The setting: a stack of ``Linear(2048, 2048)`` blocks (each one FSDP2 unit)
of about 50M, 100M and 200M parameters, AdamW state after one step (so the
state is 12 bytes a parameter: 0.6, 1.2 and 2.4 GB in all, half on each
rank). Subjects, each in its own pair of fresh processes, alternating:

* ``faccel``: ``faccel.checkpoint`` (the sharded format: each rank writes its
  own shard file, SHA-256 of every 4 MiB block, every file and folder
  fsynced, one rename to commit), then ``faccel.restore`` into a fresh model
  and optimizer (each rank reads only its rows, every byte checked, every
  check and staged load before anything is touched);
* ``DCP``: ``torch.distributed.checkpoint.save`` of ``get_state_dict``'s
  sharded state to a ``FileSystemWriter`` (fsyncs its files; no checksums,
  no atomic commit, a pickled ``.metadata``), then, into a fresh model and
  optimizer, ``get_state_dict`` + ``dcp.load`` + ``set_state_dict``, as
  PyTorch documents it.

Time: wall clock from a barrier before the call to a barrier after it (the
slower rank's time). Memory: each rank's resident set size (``/proc/self/statm``),
sampled every 2 ms by a thread during the call; the figure is the larger of
the two ranks' peaks (the whole process: model, optimizer and what the call
adds). The processes run with ``MALLOC_MMAP_THRESHOLD_=65536`` so freed
tensors go back to the OS for both subjects alike. Restores read from the
disk, as a resume after a crash does: before each restore, every file of the
checkpoint is dropped from the page cache (``posix_fadvise(DONTNEED)``), for
both subjects alike. (faccel drops its files' pages once they are durable
anyway; DCP's would otherwise still be cached.)

    python benchmarks/bench_sharded_checkpoint.py                 # 50M, 100M, 200M; 3 rounds
    python benchmarks/bench_sharded_checkpoint.py --sizes 50 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Peak, rank_env, run_ranks

WIDTH = 2048
FACCEL, DCP = "faccel", "DCP"


class Stack(nn.Module):
    """``blocks`` Linear(WIDTH, WIDTH) layers in a ModuleList: FSDP2 shards each one."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


def blocks_for(millions: int) -> int:
    return max(1, round(millions * 1e6 / (WIDTH * WIDTH + WIDTH)))


def _build(dist: Any, blocks: int, *, train: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
    import faccel

    torch.manual_seed(0)
    model = Stack(blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = faccel.prepare(dist, model, optimizer)
    if train:
        model(torch.randn(8, WIDTH)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, optimizer


def _evict(folder: Path) -> None:
    """Every file under ``folder`` made durable and dropped from the page cache: a cold restore."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _timed(dist: Any, call: Any) -> tuple[float, int]:
    torch.distributed.barrier()
    gc.collect()
    with Peak() as peak:
        start = time.perf_counter()
        call()
        torch.distributed.barrier()
        seconds = time.perf_counter() - start
    return seconds, peak.peak


def _rank(rank: int, port: int, payload: dict[str, Any], out: str) -> None:
    os.environ.update(rank_env(rank, port))
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import attrs
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import faccel
    import faccel._checkpoint._save  # imported before timing, as DCP is

    dist = faccel.detect(strategy="fsdp")
    subject, blocks, folder = payload["subject"], payload["blocks"], Path(payload["folder"])
    model, optimizer = _build(dist, blocks, train=True)
    if subject == FACCEL:
        state = attrs.evolve(faccel.TrainState.create(model=model, optimizer=optimizer), step=1, epoch=1)
        save = lambda: faccel.checkpoint(dist, state, folder)  # noqa: E731
    else:

        def save() -> None:
            msd, osd = get_state_dict(model, optimizer)
            dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(folder)))

    save_s, save_peak = _timed(dist, save)
    del model, optimizer, save
    if subject == FACCEL:
        del state
    gc.collect()
    if rank == 0:
        _evict(folder)
    model, optimizer = _build(dist, blocks, train=False)
    if subject == FACCEL:
        fresh = faccel.TrainState.create(model=model, optimizer=optimizer)
        restore = lambda: faccel.restore(dist, fresh, folder)  # noqa: E731
    else:

        def restore() -> None:
            msd, osd = get_state_dict(model, optimizer)
            dcp.load({"model": msd, "optim": osd}, storage_reader=dcp.FileSystemReader(str(folder)))
            set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)

    restore_s, restore_peak = _timed(dist, restore)
    figures = torch.tensor([save_s, restore_s, save_peak / 1e9, restore_peak / 1e9], dtype=torch.float64)
    torch.distributed.all_reduce(figures, op=torch.distributed.ReduceOp.MAX)
    if rank == 0:
        names = ["save_s", "restore_s", "save_peak_gb", "restore_peak_gb"]
        Path(out).write_text(json.dumps(dict(zip(names, figures.tolist(), strict=True))))


def measure(millions: int, subject: str, scratch: Path) -> dict[str, float]:
    folder = scratch / f"{subject}-{millions}"
    shutil.rmtree(folder, ignore_errors=True)
    payload = {"subject": subject, "blocks": blocks_for(millions), "folder": str(folder)}
    try:
        return run_ranks(_rank, payload, what=f"{subject} {millions}M")  # type: ignore[return-value]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50,100,200", help="millions of parameters, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="the figures are medians over the rounds")
    parser.add_argument(
        "--scratch", default=None, help="folder for the checkpoints (default: a temporary one)"
    )
    args = parser.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the spawned ranks
    scratch = Path(args.scratch or tempfile.mkdtemp(prefix="faccel-bench-"))
    print("size  subject  save s  restore s  save peak GB  restore peak GB   (max over 2 ranks; medians)")
    for millions in (int(s) for s in args.sizes.split(",")):
        got: dict[str, list[dict[str, float]]] = {FACCEL: [], DCP: []}
        for round_ in range(args.rounds):
            order = [FACCEL, DCP] if round_ % 2 == 0 else [DCP, FACCEL]
            for subject in order:
                got[subject].append(measure(millions, subject, scratch))
        med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in got.items()}
        for subject in (FACCEL, DCP):
            m = med[subject]
            print(
                f"{millions:>4}M {subject:>7} {m['save_s']:7.2f} {m['restore_s']:10.2f} "
                f"{m['save_peak_gb']:13.2f} {m['restore_peak_gb']:16.2f}"
            )
        f, d = med[FACCEL], med[DCP]
        ratio = {key: f[key] / d[key] for key in f}
        print(
            f"{millions:>4}M  ratio   {ratio['save_s']:7.2f} {ratio['restore_s']:10.2f} "
            f"{ratio['save_peak_gb']:13.2f} {ratio['restore_peak_gb']:16.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
