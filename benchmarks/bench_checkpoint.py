"""Checkpoint cost: faccel's durable, atomic, pickle-free checkpoint vs ``torch.save`` + fsync.

The setting: an MLP of Linear layers with ~50M parameters and AdamW
state (after one step, so the state exists): 200 MB of weights, 400 MB of
optimizer state. Subjects, in interleaved rounds:

* ``plain PyTorch``: ``torch.save`` of the model's and the optimizer's state
  dicts to two files, each fsynced (durable, but neither atomic nor pickle-free);
* ``faccel``: ``faccel.checkpoint`` (safetensors + JSON, BLAKE3 of every
  file, every file and folder fsynced, one rename to commit);
* ``disk``: plain writes of the same number of bytes to one file, fsynced:
  what the disk itself costs.

Restore: ``faccel.restore`` (every file read and hashed, everything checked,
then loaded into the objects) vs ``torch.load(weights_only=True)`` of the two
files plus ``load_state_dict`` into the same objects, beside a plain read of
the same number of bytes (all three from the page cache: faccel drops its
files' pages once they are durable, so its warm-up round reads them from the
disk, and the timed rounds find them cached, as the others').

    python benchmarks/bench_checkpoint.py            # 50M parameters, 7 rounds
    python benchmarks/bench_checkpoint.py --quick    # ~4M parameters, 3 rounds
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import FACCEL, PLAIN, Row, interleave, rows

DISK = "disk"
SIZES = {False: [2048, 4096, 4096, 4096, 2048], True: [1024, 1536, 1024, 512]}


def mlp(sizes: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(sizes):
        layers += [nn.Linear(fan_in, fan_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _timed(fn: Callable[[], Any], before: Callable[[], Any] | None = None) -> Callable[[], float]:
    """A subject for ``interleave``: untimed ``before`` (clean-up), then ``fn`` timed."""
    import time

    def run() -> float:
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def _setup(quick: bool) -> tuple[Any, Any, Any]:
    import faccel

    model = mlp(SIZES[quick])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(2, SIZES[quick][0])).sum().backward()
    optimizer.step()  # AdamW's state exists after a step
    optimizer.zero_grad(set_to_none=True)
    dist = faccel.detect({})
    return dist, faccel.TrainState.create(model=model, optimizer=optimizer), model


def run(quick: bool) -> list[Row]:
    import faccel

    dist, state, model = _setup(quick)
    parameters = sum(p.numel() for p in model.parameters())
    rounds = 3 if quick else 7
    work = Path(tempfile.mkdtemp(prefix="faccel-bench-"))
    try:
        ours, theirs, disk = work / "ours", work / "theirs", work / "disk.bin"
        theirs.mkdir()
        steps = iter(range(10**9))

        def clear_ours() -> None:
            shutil.rmtree(ours, ignore_errors=True)

        def faccel_checkpoint() -> None:
            faccel.checkpoint(
                dist, faccel.TrainState.create(model=model, optimizer=state.optimizer, step=next(steps)), ours
            )

        def clear_theirs() -> None:
            for name in os.listdir(theirs):
                os.remove(theirs / name)

        def torch_save() -> None:
            for name, obj in (
                ("model.pt", model.state_dict()),
                ("optimizer.pt", state.optimizer.state_dict()),
            ):
                with open(theirs / name, "wb") as handle:
                    torch.save(obj, handle)
                    handle.flush()
                    os.fsync(handle.fileno())

        faccel_checkpoint()  # size the disk subject: the checkpoint's own byte count
        nbytes = sum(f.stat().st_size for f in next(ours.iterdir()).iterdir())
        payload = memoryview(os.urandom(1 << 24))

        def clear_disk() -> None:
            disk.unlink(missing_ok=True)

        def disk_write() -> None:
            fd = os.open(disk, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                left = nbytes
                while left:
                    left -= os.write(fd, payload[: min(left, len(payload))])
                os.fsync(fd)
            finally:
                os.close(fd)

        saves = interleave(
            {
                PLAIN: _timed(torch_save, clear_theirs),
                FACCEL: _timed(faccel_checkpoint, clear_ours),
                DISK: _timed(disk_write, clear_disk),
            },
            rounds=rounds,
        )
        case = f"checkpoint, MLP {parameters / 1e6:.1f}M params + AdamW ({nbytes / 1e6:.0f} MB), durable"
        save_rows = rows(
            case,
            saves,
            baseline=PLAIN,
            unit="s",
            goals="checkpoint",
            notes={
                PLAIN: "torch.save(model/optimizer state_dict) + fsync each file",
                FACCEL: "faccel.checkpoint: safetensors + JSON, BLAKE3, fsync files+dirs, atomic rename",
                DISK: f"write+fsync of the same {nbytes / 1e6:.0f} MB",
            },
        )

        def faccel_restore() -> None:
            faccel.restore(dist, state, ours)

        def torch_restore() -> None:
            model.load_state_dict(torch.load(theirs / "model.pt", weights_only=True))
            state.optimizer.load_state_dict(torch.load(theirs / "optimizer.pt", weights_only=True))

        def disk_read() -> None:
            buffer = bytearray(nbytes)
            with open(disk, "rb", buffering=0) as handle:
                view, got = memoryview(buffer), 0
                while got < nbytes:
                    got += handle.readinto(view[got:]) or nbytes

        torch_save()
        disk_write()
        loads = interleave(
            {PLAIN: _timed(torch_restore), FACCEL: _timed(faccel_restore), DISK: _timed(disk_read)},
            rounds=rounds,
        )
        load_rows = rows(
            f"restore, MLP {parameters / 1e6:.1f}M params + AdamW",
            loads,
            baseline=PLAIN,
            unit="s",
            goals="restore",
            notes={
                PLAIN: "torch.load(weights_only=True) x2 + load_state_dict",
                FACCEL: "faccel.restore: read + BLAKE3 of every byte + all checks, then load in place",
                DISK: f"plain read of the same {nbytes / 1e6:.0f} MB (page cache, as the others)",
            },
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return save_rows + load_rows


def _table(found: list[Row]) -> str:
    lines = [f"{'case / subject':<58} {'median':>9} {'ratio':>7} {'[min, max]':>15}  note"]
    case = None
    for row in found:
        if row.case != case:
            case = row.case
            lines.append(case)
        ratio = "" if row.median is None else f"{row.median:.2f}"
        spread = "" if row.low is None else f"[{row.low:.2f}, {row.high:.2f}]"
        target = "" if row.target is None else f" (target <= {row.target})"
        lines.append(f"  {row.subject:<56} {row.value:>8.3f}s {ratio:>7} {spread:>15}  {row.note}{target}")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="faccel.checkpoint vs torch.save + fsync")
    parser.add_argument("--quick", action="store_true", help="a ~4M-parameter model, 3 rounds")
    torch.set_num_threads(1)
    found = run(parser.parse_args().quick)
    print(_table(found))
    by = {(r.case.split(",")[0], r.subject): r for r in found}
    disk_row = by[("checkpoint", DISK)]
    plain_row = by[("checkpoint", PLAIN)]
    ratio = statistics.median([by[("checkpoint", FACCEL)].median or 0.0])
    print(
        f"checkpoint / torch.save+fsync: {ratio:.2f} (Accelerate 1.01, Fabric 2.42); "
        f"disk write+fsync alone: {disk_row.value:.3f}s ({disk_row.median:.2f} of torch.save); "
        f"restore / torch.load+load_state_dict: {by[('restore', FACCEL)].median:.2f}; "
        f"torch.save+fsync: {plain_row.value:.3f}s"
    )
