"""Checkpoints on object storage: upload and download throughput against a local S3 server.

moto's S3 server on 127.0.0.1 (in this process, dummy credentials), one rank:
an MLP with AdamW state. Side by side in each round, in alternating order:

* faccel: ``checkpoint(dist, state, "s3://bucket/...")`` (whole-tensor format,
  every object hashed as it is uploaded, the manifest last) and
  ``restore`` from it (every object's size and hash checked);
* ``torch.distributed.checkpoint`` with its fsspec writer and reader
  (``FsspecWriter`` / ``FsspecReader``, one file per rank, its default
  torch-save serialization), saving and loading the same model and optimizer
  state dicts.

Throughput is the state's bytes over the call's time, per rank (one rank here).
The non-blocking stall is ``checkpoint(..., blocking=False)``'s return time over
a blocking checkpoint's. The server keeps objects in memory, so the figures
measure the client side (hashing, copies, requests), not a network.

    python benchmarks/bench_object_store.py            # ~150 MB of state, 3 rounds
    python benchmarks/bench_object_store.py --quick    # ~25 MB, 2 rounds
"""

from __future__ import annotations

import argparse
import os
import secrets
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import FACCEL, Row

CASE = "object storage (moto S3 on 127.0.0.1), one rank, MLP + AdamW"
DCP = "torch.distributed.checkpoint (fsspec)"
# Width and depth of the MLP: ~12.6M parameters (~150 MB with AdamW), or ~2.1M (~25 MB).
SIZES = {False: (1024, 12), True: (512, 8)}


def _server() -> tuple[Any, dict[str, str]]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ENDPOINT_URL_S3": f"http://{host}:{port}",
    }
    return server, env


def _state(quick: bool) -> tuple[Any, Any, int]:
    import faccel

    width, depth = SIZES[quick]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(depth)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    optimizer.step()
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    size += sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )
    return faccel.detect({}), state, size


def _dcp_save(state: Any, url: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    dcp.save(
        {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()},
        storage_writer=FsspecWriter(url),
    )


def _dcp_load(state: Any, url: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    target = {"model": state.model.state_dict(), "optim": state.optimizer.state_dict()}
    dcp.load(target, storage_reader=FsspecReader(url))
    state.model.load_state_dict(target["model"])


def measure(quick: bool) -> dict[str, list[float]]:
    """Seconds per round of each subject's save and load, and the non-blocking stall."""
    import warnings

    import s3fs

    import faccel
    from faccel._checkpoint._background import wait

    server, env = _server()
    saved_env = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    times: dict[str, list[float]] = {
        key: [] for key in ("faccel save", "faccel load", "dcp save", "dcp load", "blocking", "stall")
    }
    try:
        bucket = f"bench-{secrets.token_hex(4)}"
        s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
        dist, state, _ = _state(quick)
        rounds = 2 if quick else 3
        for index in range(rounds + 1):  # the first round warms up (imports, connections)
            order = ("faccel", "dcp") if index % 2 else ("dcp", "faccel")
            for who in order:
                url = f"s3://{bucket}/{who}-{index}"
                start = time.perf_counter()
                if who == "faccel":
                    faccel.checkpoint(dist, attrs.evolve(state, step=index), url)
                else:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        _dcp_save(state, url)
                saved = time.perf_counter() - start
                start = time.perf_counter()
                if who == "faccel":
                    faccel.restore(dist, state, url)
                else:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        _dcp_load(state, url)
                loaded = time.perf_counter() - start
                if index:
                    times[f"{who} save"].append(saved)
                    times[f"{who} load"].append(loaded)
            url = f"s3://{bucket}/stall-{index}"
            start = time.perf_counter()
            faccel.checkpoint(dist, attrs.evolve(state, step=index), url, blocking=False)
            stall = time.perf_counter() - start
            wait(dist.runtime)
            start = time.perf_counter()
            faccel.checkpoint(dist, attrs.evolve(state, step=index), f"{url}-blocking")
            if index:
                times["stall"].append(stall)
                times["blocking"].append(time.perf_counter() - start)
    finally:
        server.stop()
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return times


def run(quick: bool) -> list[Row]:
    """The rows of docs/benchmarks.md: throughput per rank of each subject, and the stall."""
    _, _, size = _state(quick)
    times = measure(quick)
    rows = []
    for kind, word in (("save", "upload"), ("load", "download")):
        ours, theirs = times[f"faccel {kind}"], times[f"dcp {kind}"]
        case = f"{CASE}, {size / 1e6:.0f} MB: {word} (checkpoint / restore), s per call"
        ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
        rows.append(
            Row(
                case=case,
                subject=DCP,
                value=statistics.median(theirs),
                unit="s",
                rounds=len(theirs),
                note=f"{size / 1e6 / statistics.median(theirs):.0f} MB/s per rank",
            )
        )
        rows.append(
            Row(
                case=case,
                subject=FACCEL,
                value=statistics.median(ours),
                unit="s",
                baseline=DCP,
                median=statistics.median(ratios),
                low=min(ratios),
                high=max(ratios),
                target=1.0,
                rounds=len(ours),
                note=f"{size / 1e6 / statistics.median(ours):.0f} MB/s per rank; every object hashed",
            )
        )
    stall = [a / b for a, b in zip(times["stall"], times["blocking"], strict=True)]
    rows.append(
        Row(
            case=f"{CASE}, {size / 1e6:.0f} MB: non-blocking checkpoint's stall / a blocking one",
            subject=FACCEL,
            value=statistics.median(times["stall"]),
            unit="s",
            baseline="blocking checkpoint",
            median=statistics.median(stall),
            low=min(stall),
            high=max(stall),
            rounds=len(stall),
            note="host copy and planning; the upload runs on the background thread",
        )
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for row in run(args.quick):
        print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main())
