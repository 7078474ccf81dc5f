"""Resuming an interrupted epoch at another world size, DDP and FSDP2, on real gloo processes.

Each pair trains one epoch and part of the next at one world size, checkpoints, restores at the
other and finishes the epoch. Across the two runs every sample of the interrupted epoch is read
exactly once, plus the padding the resumed loader reports; the model, optimizer and scheduler come
back as saved; ranks that existed draw from their saved generators, new ranks from
``new_rank_seed(seed, step, rank)``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from faccel._checkpoint._load import new_rank_seed
from tests.distributed import harness, resize_workers

ROOT = Path(__file__).resolve().parents[2]
REHEARSAL = ROOT / "tests" / "distributed" / "scripts" / "resize_rehearsal.py"

PAIRS = {
    "ddp": [(1, 2), (2, 1), (2, 3), (4, 2), (3, 4)],
    "fsdp": [(2, 1), (2, 3), (4, 2)],
}


def check_coverage(first: list[dict], second: list[dict]) -> int:
    """Every sample of the epoch once over both runs, plus the padding reported; returns the padding."""
    counts = Counter(i for r in [*first, *second] for i in r["seen"])
    padding = second[0]["padding"]
    assert all(r["padding"] == padding for r in second)
    assert set(counts) == set(range(resize_workers.SAMPLES))
    assert sum(counts.values()) == resize_workers.SAMPLES + padding
    # Padding repeats happen only in the resumed run, never in the interrupted one.
    assert max(Counter(i for r in first for i in r["seen"]).values()) == 1
    return padding


def check_carried_over(first: list[dict], second: list[dict], new_rank_seed) -> None:
    for r in second:
        assert r["digest"] == first[0]["digest"]  # model, optimizer, scheduler: as saved
        assert r["lr"] == first[0]["lr"]
        assert "resumed at another world size" in r["old_form"]
        assert r["finite"] and r["next_epoch_batches"] > 0
    for rank, r in enumerate(second):
        if rank < len(first):
            assert r["draw"] == first[rank]["draw"]  # its own saved generators
        else:
            seed = new_rank_seed(first[0]["seed"], first[0]["step"], rank)
            assert r["draw"] == torch.rand(1, generator=torch.Generator().manual_seed(seed)).item()


@pytest.mark.parametrize(
    ("strategy", "before", "after"), [(s, a, b) for s, pairs in PAIRS.items() for a, b in pairs]
)
def test_an_epoch_resumed_at_another_world_size_reads_each_sample_once(
    tmp_path: Path, strategy: str, before: int, after: int
) -> None:
    from faccel import Sharding

    # Stop after 3 batches of epoch 1: 3 x before x 2 of the 26 samples read.
    first = harness.run(
        resize_workers.interrupted, world_size=before, root=str(tmp_path), strategy=strategy, stop=3
    )
    second = harness.run(resize_workers.resumed, world_size=after, root=str(tmp_path), strategy=strategy)
    consumed = 3 * before * 2
    for r in second:
        assert r["epoch_position_consumed"] == [1, 0, consumed]
    padding = check_coverage(first, second)
    law = Sharding(num_samples=resize_workers.SAMPLES, batch_size=2, world_size=after, consumed=consumed)
    assert padding == law.padding < after
    check_carried_over(first, second, new_rank_seed)


def test_under_drop_last_the_resumed_ranks_drop_the_remainders_incomplete_round(tmp_path: Path) -> None:
    """2 ranks read 12 of 26 samples; 3 ranks read 2 rounds of 6 of the 14 left and drop 2."""
    kwargs = {"root": str(tmp_path), "strategy": "ddp", "drop_last": True}
    first = harness.run(resize_workers.interrupted, world_size=2, stop=3, **kwargs)
    second = harness.run(resize_workers.resumed, world_size=3, **kwargs)
    counts = Counter(i for r in [*first, *second] for i in r["seen"])
    assert max(counts.values()) == 1 and len(counts) == 24  # each at most once, 2 dropped
    assert [len(r["seen"]) for r in second] == [4, 4, 4] and second[0]["padding"] == 0
    check_carried_over(first, second, new_rank_seed)


@pytest.mark.parametrize("last", [2, 3])
def test_a_checkpoint_inside_a_resumed_epoch_resumes_exactly(tmp_path: Path, last: int) -> None:
    """2 ranks read 12 samples; 3 ranks resume, read one batch each (6) and checkpoint; 2 or 3 finish.

    At 3 ranks (the same world size) the saved position counts batches from the 12 read before.
    """
    first = harness.run(
        resize_workers.interrupted, world_size=2, root=str(tmp_path / "a"), strategy="ddp", stop=3
    )
    again = str(tmp_path / "b")
    second = harness.run(
        resize_workers.resumed, world_size=3, root=str(tmp_path / "a"), strategy="ddp", again=again
    )
    third = harness.run(resize_workers.resumed, world_size=last, root=again, strategy="ddp")
    where = [1, 0, 18] if last == 2 else [1, 1, 12]
    assert [r["epoch_position_consumed"] for r in third] == [where] * last
    assert all("resumed at another world size" in r["old_form"] for r in third)
    read = [{"seen": r["before_again"]} for r in second]
    check_coverage([*first, *read], third)


def test_ranks_that_cannot_see_each_others_files_fail_cleanly(tmp_path: Path) -> None:
    """Nodes with their own disks (a folder per rank): checkpoint and restore fail on every rank.

    The shared-file-system requirement of docs/checkpoints.md, as it shows when it is not met:
    a named CheckpointError on every rank, nothing committed, nothing loaded.
    """
    zero, one = harness.run(resize_workers.unshared_folders, world_size=2, base=str(tmp_path))
    assert "No such file or directory" in one["checkpoint"] and "rng-00001.json" in one["checkpoint"]
    assert "failed on 1 other rank(s)" in zero["checkpoint"]
    # Nothing committed on either "node" (an invisible temporary folder, removed by the next writer).
    assert not [name for name in zero["left"] if name.startswith("step-")] and one["left"] is None
    assert "no checkpoint there" in one["restore"] and "failed on 1 other rank(s)" in zero["restore"]
    assert zero["unchanged"] and one["unchanged"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_two_torchrun_nodes_checkpoint_and_three_ranks_resume(tmp_path: Path) -> None:
    """A multi-node rehearsal on one machine: two torchrun agents (--nnodes 2 --nproc-per-node 2,
    c10d rendezvous on localhost) train and checkpoint; one agent of 3 ranks resumes and finishes."""
    root, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-m", "torch.distributed.run"]
    rendezvous = [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-id",
        "rehearsal",
    ]
    rendezvous += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}", "--monitor-interval", "0.1"]
    script = [str(REHEARSAL), str(root), str(out)]
    agents = [
        subprocess.Popen(
            [
                *run,
                *rendezvous,
                "--node-rank",
                str(node),
                "--rdzv-conf",
                f"is_host={node == 0}",
                *script,
                "first",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=ROOT,
        )
        for node in (0, 1)
    ]
    outputs = [agent.communicate(timeout=120)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    resume = subprocess.run(
        [*run, "--standalone", "--nproc-per-node", "3", "--monitor-interval", "0.1", *script, "resume"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    assert resume.returncode == 0, (resume.stdout + resume.stderr)[-3000:]
    first = [json.loads((out / f"first-{rank}.json").read_text()) for rank in range(4)]
    second = [json.loads((out / f"resume-{rank}.json").read_text()) for rank in range(3)]
    assert sorted((r["world_size"], r["node"]) for r in first) == [(4, 0), (4, 0), (4, 1), (4, 1)]
    assert [r["world_size"] for r in second] == [3, 3, 3]
    counts = Counter(i for r in [*first, *second] for i in r["seen"])
    assert sum(len(r["seen"]) for r in first) == 3 * 4 * 2  # three batches of 2 on 4 ranks
    assert set(counts) == set(range(30)) and sum(counts.values()) == 30 + second[0]["padding"]
