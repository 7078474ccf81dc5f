"""Context parallelism end to end: needs CUDA (torch's ring attention has no CPU kernel).

Marked ``cuda`` and skipped without GPUs; ``scripts/check_cuda.sh`` runs them. The two-rank case
needs two GPUs (NCCL). Tolerance: rtol 1e-4 / atol 1e-5 in float32: ring attention adds each
query's partial softmax sums chunk by chunk (an online softmax, rescaled per chunk) instead of in
one kernel over the whole row, and the flash / memory-efficient kernels the GPU picks differ from
one process's by their own blocking, which moves float32 results by a few ulps to ~1e-6.
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import context_workers, harness

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOLERANCE = {"rel": 1e-4, "abs": 1e-5}


def test_context_of_one_on_a_gpu_runs_the_plain_step() -> None:
    import faccel

    dist = faccel.detect({})
    assert faccel.context_attention is not None and dist.device.type == "cuda"
    result = context_workers.reference_step()
    assert result["loss"] > 0 and all(result["grads"].values())


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="context parallelism needs two GPUs")
def test_context_parallel_step_matches_one_process() -> None:
    reference = context_workers.reference_step()
    ranks = harness.run(context_workers.context_step, world_size=2, timeout=300)
    for r in ranks:
        assert r["loss"] == pytest.approx(reference["loss"], **TOLERANCE)
        for name, grad in reference["grads"].items():
            assert r["grads"][name] == pytest.approx(grad, **TOLERANCE), name
