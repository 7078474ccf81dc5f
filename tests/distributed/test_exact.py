"""Exact mode over real gloo processes: the same bits at sizes 1, 2 and 4 and across resizes (issue 34).

The headline: examples/exact_any_scale.py's loop (a small transformer with dropout, AdamW, a
schedule, clipping, accumulation of 2 and the loss by token count) for 20 optimizer steps over
2 epochs ends with the same SHA-256 of the weights and AdamW state, and the same losses, on 1, 2
and 4 processes, and on 2 processes stopped at step 7, resumed on 4, stopped at step 14 and
finished on 1. ``scripts/prove_exact.py`` adds 8 processes and longer resize chains.
"""

from __future__ import annotations

from pathlib import Path

from tests.distributed import exact_workers, harness


def test_the_weights_are_bitwise_equal_at_sizes_1_2_4_and_across_resizes(tmp_path: Path) -> None:
    straight = {size: harness.run(exact_workers.train, world_size=size, timeout=240) for size in (1, 2, 4)}
    reference = straight[1][0]
    assert len(reference["losses"]) == 20
    for size, results in straight.items():
        for result in results:  # every rank of every size
            assert result["digest"] == reference["digest"], size
            assert result["losses"] == reference["losses"], size
    root = str(tmp_path / "ckpt")
    first = harness.run(exact_workers.train, world_size=2, timeout=240, root=root, stop_at=7)
    second = harness.run(exact_workers.train, world_size=4, timeout=240, root=root, stop_at=14, resume=True)
    third = harness.run(exact_workers.train, world_size=1, timeout=240, root=root, resume=True)
    assert [first[0]["step"], second[0]["step"], third[0]["step"]] == [7, 14, 20]
    assert first[0]["losses"] + second[0]["losses"] + third[0]["losses"] == reference["losses"]
    assert third[0]["digest"] == reference["digest"]


def test_different_thread_counts_and_ddps_own_all_reduce_are_refused_on_every_rank() -> None:
    results = harness.run(exact_workers.refusals, world_size=2)
    for result in results:
        assert "torch.get_num_threads() = [1, 2] by rank" in result["threads"]
        assert "inside `with faccel.accumulate(dist, model, micro):`" in result["no_sync"]


def test_the_exchange_cut_in_chunks_leaves_every_rank_the_simulated_sum() -> None:
    """Chunks of 3 over odd pieces (and a buffer shorter than the world): the bits simulate_exchange gives."""
    import torch

    from faccel._loop._exact._tree_reduce import simulate_exchange

    results = harness.run(exact_workers.chunked_exchange, world_size=4)
    expected = simulate_exchange(exact_workers.nodes(4))
    for rank, got in enumerate(results):
        assert got == [b.view(torch.uint8).tolist() for b in expected[rank]], rank


def test_the_exchange_started_bucket_by_bucket_in_the_last_backward_gives_the_serial_bits() -> None:
    """Two ranks start each bucket's exchange from a gradient hook; the bits are one process's."""
    one = harness.run(exact_workers.overlapped_and_serial, world_size=1, bucket=64)[0]
    two = harness.run(exact_workers.overlapped_and_serial, world_size=2, bucket=64)
    assert one["overlapped"] == one["serial"]
    assert one["overlapped early"] == [0, 0, 0]  # one process: nothing to exchange, no hooks
    for rank in two:
        assert rank["overlapped"] == rank["serial"] == one["overlapped"]
        # Every bucket but the one holding the parameter no forward uses starts inside the backward.
        # scale (float64, registered first); unused with head (contiguous, under 64); body.2; body.0
        assert rank["overlapped buckets"] == 4
        assert rank["overlapped early"] == [rank["overlapped buckets"] - 1] * 3
        assert rank["serial early"] == [0, 0, 0]
        # One hook per parameter; shutdown removes them.
        assert (rank["hooks"], rank["hooks after shutdown"]) == (9, 0)
    assert (one["hooks"], one["hooks after shutdown"]) == (0, 0)  # one process: none
