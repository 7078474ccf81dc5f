"""4-D-style layouts on 8 gloo processes: three dimensions larger than 1 at once, against one process.

Marked ``eight_ranks`` and skipped unless ``FACCEL_TEST_EIGHT=1``: 8 processes on a 2-core machine
are kept out of the default suite's budget. ``scripts/prove_eight_ranks.sh`` runs them (measured
here: about 20 s each on 2 loaded cores).

Each trains tests/distributed/pipeline_workers.py's ``Net`` (its blocks split column-wise over the
tensor ranks, outputs gathered) for 3 SGD steps with clipping at 0.5, through
``faccel.forward_backward``, and compares losses, norms and the final weights by name with one
process. Tolerance rel 1e-5 / abs 1e-6 (float32), not bitwise: micro-batches (pipeline), halves and
quarters of the batch averaged by FSDP2, and column-wise partial products gathered sum in another
order than one process's matmul (observed: 1.2e-7).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from tests.distributed import harness, pipeline_workers

pytestmark = [
    pytest.mark.eight_ranks,
    pytest.mark.skipif(
        os.environ.get("FACCEL_TEST_EIGHT") != "1",
        reason="8 processes: run with FACCEL_TEST_EIGHT=1 (scripts/prove_eight_ranks.sh)",
    ),
]
TOLERANCE = {"rel": 1e-5, "abs": 1e-6}


@pytest.mark.parametrize("layout", ["pipeline=2,shard=2,tensor=2", "replicate=2,shard=2,tensor=2"])
def test_three_dimensions_train_like_one_process(layout: str) -> None:
    with torch.random.fork_rng():
        reference: dict[str, Any] = pipeline_workers.train(None, "1f1b", "function")
    ranks = harness.run(
        pipeline_workers.train, world_size=8, timeout=600, layout=layout, kind="1f1b", split="function"
    )
    names: set[str] = set()
    for r in ranks:
        assert r["loss"] == pytest.approx(reference["loss"], **TOLERANCE)
        assert r["norm"] == pytest.approx(reference["norm"], **TOLERANCE)
        for name, value in r["weights"].items():
            assert value == pytest.approx(reference["weights"][name], **TOLERANCE), name
        names |= set(r["weights"])
    assert names == set(reference["weights"])
