"""4-D-style layouts on 8 gloo processes: three dimensions larger than 1 at once, against one process.

Marked ``eight_ranks`` and skipped unless ``FACCEL_TEST_EIGHT=1``: 8 processes on a 2-core machine
are kept out of the default suite's budget. ``scripts/prove_eight_ranks.sh`` runs them (measured
2026-12-04 on this 2-core machine, shared with other work: the three tests in 50 s).

Each trains tests/distributed/pipeline_workers.py's ``Net`` (its blocks split column-wise over the
tensor ranks, outputs gathered) for 3 SGD steps with clipping at 0.5, through
``faccel.forward_backward``, and compares losses, norms and the final weights by name with one
process. Tolerance rel 1e-5 / abs 1e-6 (float32), not bitwise: micro-batches (pipeline), halves and
quarters of the batch averaged by FSDP2, and column-wise partial products gathered sum in another
order than one process's matmul (observed: 1.2e-7).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
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


def test_pipeline_shard_tensor_checkpoint_restores_at_pipeline_1_and_4(tmp_path: Path) -> None:
    """pipeline=2 x shard=2 x tensor=2 (stages built from the model's modules, FSDP2 and a column-wise
    plan inside each): 3 Adam steps, a checkpoint (each rank writes only its own rows), 2 more steps,
    save_model (loaded in one process: the final weights).
    Restored at pipeline=1 (shard=4,tensor=2) and at pipeline=4 (pipeline=4,shard=2) on 8 ranks: every
    weight and Adam moment bitwise the saved floats; the 2 continued steps' losses equal the
    uninterrupted run's within the float32 tolerance (another summation order)."""
    from tests.distributed.test_pipeline_checkpoint import _check, _check_export

    root = str(tmp_path / "ckpt")
    ranks = harness.run(
        pipeline_workers.ckpt_save,
        world_size=8,
        timeout=600,
        layout="pipeline=2,shard=2,tensor=2",
        root=root,
        export=str(tmp_path / "export"),
    )
    _check_export(tmp_path / "export", ranks)  # save_model too: the final weights, the same floats
    values: dict[str, Any] = {}
    for r in ranks:
        values |= r["values"]
    saved = {"values": values, "after": ranks[0]["after"]}
    index = json.loads((Path(root) / "step-000000000003" / "state.json").read_text())["tensors"]["model"]
    for name, entry in index.items():  # each stage's 4 ranks (0-3, 4-7) write a quarter of the rows each
        stage = 0 if name.startswith(("embed.", "layers.0.", "layers.1.")) else 1
        assert (entry["first"], entry["block"]) == (4 * stage, -(-entry["shape"][0] // 4)), name
    for layout in ("shard=4,tensor=2", "pipeline=4,shard=2"):
        back = harness.run(pipeline_workers.ckpt_resume, world_size=8, timeout=600, layout=layout, root=root)
        _check(back, saved, same_layout=False)
