"""Collectives on two real gloo processes, and a failing rank under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.distributed import collective_workers, harness

ROOT = Path(__file__).resolve().parents[2]


def test_gather_reduce_broadcast_pad_and_objects_on_two_ranks() -> None:
    results = harness.run(collective_workers.collectives_roundtrip, world_size=2)
    assert results[0] == {**results[1], "padded": results[0]["padded"], "left": results[0]["left"]}
    r = results[0]
    # rank 0 had 2 rows, rank 1 had 3: kept whole, in rank order, no padding rows
    assert r["x"] == [
        [0.0, 1.0, 2.0],
        [3.0, 4.0, 5.0],
        [100.0, 101.0, 102.0],
        [103.0, 104.0, 105.0],
        [106.0, 107.0, 108.0],
    ]
    assert (r["pair_type"], r["first"]) == ("Pair", [0, 0, 1, 1, 1])
    assert r["flags"] == [[False, False]] * 2 + [[True, True]] * 3 and r["flags_dtype"] == "torch.bool"
    assert r["half"] == [0.5, 0.5, 1.5, 1.5, 1.5] and r["half_dtype"] == "torch.bfloat16"
    assert r["loss"] == [1.5, 2.5]  # 0-d leaves gather to (world_size,)
    assert r["inputs_untouched"]
    assert r["reduced"] == {
        "sum": {"f": [3.0, -1.0], "i": [3, 14], "h": [2.0, 2.0]},
        "mean": {"f": [1.5, -0.5], "h": [1.0, 1.0]},
        "max": {"f": [2.0, 0.0], "i": [3, 7], "h": [1.0, 1.0]},
        "min": {"f": [1.0, -1.0], "i": [0, 7], "h": [1.0, 1.0]},
    }
    assert r["reduced_dtypes"] == {"f": "torch.float32", "h": "torch.float16"}
    # rank 0 learnt rank 1's shapes and dtypes from the broadcast itself
    assert r["received"] == [[0, 10, 20, 30, 40], [[1.0, 0.0], [0.0, 1.0]], "torch.float64"]
    assert results[0]["padded"] == [[1, -1, -1], [1, -1, -1]] and results[1]["padded"] == [[2, 2, 2]] * 2
    assert r["padded_loss_shape"] == []  # too few dims to pad: unchanged
    assert results[0]["left"] == [[0, 0, 1], [0, 0, 1]] and results[1]["left"] == [[2, 2, 2]] * 2
    assert r["objects"] == [{"rank": 0, "name": "worker0"}, {"rank": 1, "name": "worker1"}]


def test_mismatches_raise_on_every_rank_naming_rank_and_leaf() -> None:
    results = harness.run(collective_workers.mismatches, world_size=2)
    assert results[0] == results[1]  # every rank raised the same error: nobody hung
    r = results[0]
    assert r["dtype"].startswith("DistributedError: tree['a'] is torch.float32 on rank 1 but torch.float64")
    assert "tree[0] has shape (2, 4) on rank 1 but (2, 3) on rank 0" in r["trailing"]
    assert "rank 1 passed a tree of structure {'a': T} but rank 0 passed {'b': T}" in r["structure"]
    assert "rank 1 called gather while rank 0 called reduce(op='sum')" in r["call"]
    assert "tree['g'] has shape (3,) on rank 1 but (2,) on rank 0" in r["reduce_shape"]
    assert r["reduce_op"].startswith("ArgumentValueError: op must be one of")
    assert r["mean_of_ints"].startswith("ArgumentError: op='mean'")
    assert "rank 1 called broadcast(src=1) while rank 0 called broadcast(src=0)" in r["broadcast_src"]
    assert r["broadcast_range"].startswith("ArgumentValueError: src must be a rank in [0, 2)")
    assert "same number of dimensions" in r["pad_ndim"]
    assert r["not_a_tensor"].startswith("ArgumentError:") and "tree['a']" in r["not_a_tensor"]
    assert r["big_tree"] == 120  # a description over 1 KiB takes a second exchange round
    assert r["after"] == [0, 1]  # the group is still in step after all those errors


def test_gather_for_metrics_returns_exactly_the_dataset_in_order_on_two_ranks() -> None:
    sizes, batch_sizes = [7, 10, 13], [2, 3]
    results = harness.run(collective_workers.metrics, world_size=2, sizes=sizes, batch_sizes=batch_sizes)
    assert results[0] == results[1]
    paddings = []
    for n in sizes:
        for b in batch_sizes:
            r = results[0][f"{n}/{b}"]
            assert r["per_batch"] == list(range(n)), (n, b)
            assert r["per_batch_indices"] == list(range(n))
            assert r["at_end"] == list(range(n)), (n, b)
            assert r["values"] == [10.0 * i for i in range(n)]
            paddings.append(r["padding"])
    assert sum(paddings) >= 3  # some of these loaders really repeated samples


def test_gather_for_metrics_under_shuffle_returns_the_epoch_order_and_its_indices() -> None:
    results = harness.run(collective_workers.metrics, world_size=2, sizes=[13], batch_sizes=[3], shuffle=True)
    r = results[0]["13/3"]
    assert r["padding"] == 1
    assert sorted(r["at_end"]) == list(range(13)) and r["at_end"] != list(range(13))
    assert r["per_batch"] == r["at_end"] == r["per_batch_indices"]


def test_a_stalled_peer_makes_the_collective_fail_after_the_timeout() -> None:
    results = harness.run(collective_workers.stalled_peer, world_size=2, timeout_s=1.0)
    error = results[0]["error"]
    assert error is not None and "gather() on rank 0 of 2 timed out after 0:00:01" in error
    assert "faccel.detect(timeout=...)" in error
    assert results[0]["waited"] > 0.9


def test_torchrun_job_fails_fast_when_one_rank_raises() -> None:
    script = ROOT / "tests" / "distributed" / "scripts" / "rank_fails.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(script), "raise"],
        capture_output=True,
        text=True,
        timeout=600,  # only a hang reaches it
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert "rank 1 failed on purpose: the evaluation file is missing" in output
    assert "never should" not in output
