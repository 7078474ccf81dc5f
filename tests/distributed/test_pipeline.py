"""Pipeline stages on real gloo processes: a user's own model, one loop, against one process.

Each case trains tests/distributed/pipeline_workers.py's ``Net`` (an input layer, four blocks in a
ModuleList, a read-out) for 3 SGD steps of 8 samples with clipping at 0.5, through
``faccel.forward_backward`` at the given layout, schedule and split, and compares the losses, the
clipping norms and the final weights (by their original names) with the same loop in one process.

Tolerance: rel 1e-5 / abs 1e-6 (float32). The arithmetic is the same but summed in another order:
each batch runs as 4 micro-batches, so a gradient is the sum of 4 partial products over 2 rows
each instead of one product over 8 rows, and the loss the mean of 4 means; the clipping norm is
combined from the stages' norms; with shard=2 FSDP2 averages two halves' gradients. Observed:
6e-8 on losses near 1.

The failure cases at the end (pipeline_workers.FAILURES, bounded): what can be checked before the
schedule is refused on every rank alike; a rank that fails or dies inside it is named on the other
(``RankFailedError``). scripts/prove_pipeline_failures.py runs the whole table, repeatedly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import harness, pipeline_workers

TOLERANCE = {"rel": 1e-5, "abs": 1e-6}

# (layout, world size, schedule, how the model is split, stages in all)
CASES = [
    ("pipeline=2", 2, "1f1b", "names", 2),
    ("pipeline=2", 2, "gpipe", "function", 2),
    ("pipeline=2", 2, "interleaved_1f1b", "names", 4),
    ("pipeline=2", 2, "zbv", "function", 4),
    ("pipeline=2", 2, "zero_bubble", "names", 4),
    ("pipeline=2,shard=2", 4, "1f1b", "names", 2),
]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    with torch.random.fork_rng():
        return pipeline_workers.train(None, "1f1b", "names")


@pytest.mark.parametrize(("layout", "world", "kind", "split", "stages"), CASES)
def test_pipelined_loop_matches_one_process(
    layout: str, world: int, kind: str, split: str, stages: int, reference: dict[str, Any]
) -> None:
    ranks = harness.run(
        pipeline_workers.train,
        world_size=world,
        timeout=240,
        layout=layout,
        kind=kind,
        split=split,
        stages=stages,
    )
    names: set[str] = set()
    for r in ranks:
        # the loss and the norm over every stage, the same on every rank
        assert r["loss"] == pytest.approx(reference["loss"], **TOLERANCE)
        assert r["norm"] == pytest.approx(reference["norm"], **TOLERANCE)
        assert r["loss"] == ranks[0]["loss"] and r["norm"] == ranks[0]["norm"]
        for name, value in r["weights"].items():  # this rank's stages, by the model's own names
            assert value == pytest.approx(reference["weights"][name], **TOLERANCE), name
        names |= set(r["weights"])
        # the optimizer steps this rank's stages only (a DTensor's numel is its whole tensor's)
        assert r["stepped"] == sum(len(v) for v in r["weights"].values())
    assert names == set(reference["weights"])  # the stages together are the whole model


@pytest.mark.parametrize("by_items", [False, True])
def test_accumulation_and_items_mean_what_they_mean_without_stages(by_items: bool) -> None:
    """2 micro-steps of 8 rows per optimizer step: a mean per micro-step, or a sum over the rows."""
    with torch.random.fork_rng():
        reference = pipeline_workers.accumulated(None, by_items)
    ranks = harness.run(
        pipeline_workers.accumulated, world_size=2, timeout=240, layout="pipeline=2", by_items=by_items
    )
    for r in ranks:
        assert r["loss"] == pytest.approx(reference["loss"], **TOLERANCE)
        for name, value in r["weights"].items():
            assert value == pytest.approx(reference["weights"][name], **TOLERANCE), name


def test_the_loss_reaches_every_rank_and_the_gradients_are_torchs_schedule_by_hand() -> None:
    """GPipe over gloo's early route (the receive posted before the schedule, the loss sent as soon as
    the last micro-batch's is made), 1F1B over the broadcast route, and 1 micro-batch (no scaling)."""
    ranks = harness.run(pipeline_workers.loss_routes, world_size=2, timeout=240)
    for kind, count, early in pipeline_workers.LOSS_ROUTES:
        case = f"{kind}/{count}/{early}"
        for r in ranks:  # each step's gradients: the same bits as torch's schedule with 1/count-scaled losses
            assert r[case]["same"] == [True, True, True], case
        # the last stage's loss, the same bits on the other rank; the mean of the micro-batch losses
        assert ranks[0][case]["loss"] == ranks[1][case]["loss"], case
        assert ranks[1][case]["loss"] == pytest.approx(ranks[1][case]["hand"], rel=1e-6), case


def test_what_checkpoints_of_stages_refuse_is_refused_loudly(tmp_path: Path) -> None:
    ranks = harness.run(pipeline_workers.refusals, world_size=2, timeout=120, root=str(tmp_path))
    for r in ranks:
        assert "written" not in r.values()
    assert all("stages are not built yet" in r["unbuilt"] and "example=" in r["unbuilt"] for r in ranks)
    assert all(
        "stages are not built yet" in r["unbuilt_load"] and "load_model" in r["unbuilt_load"] for r in ranks
    )
    assert all("sharded=False" in r["whole_tensors"] for r in ranks)
    # load_model checks the whole model on every rank: the stage without the name says whose it is
    assert "missing 'head.bias' (another pipeline stage's)" in ranks[0]["missing_name"]
    assert "missing 'head.bias'" in ranks[1]["missing_name"]
    # torch's stages exchange activations of the first batch's shapes: another size is refused, not hung
    assert all("drop_last=True" in r["other_batch_size"] for r in ranks)
    assert not (tmp_path / "early").exists() and not (tmp_path / "whole").exists()


def test_bf16_stages_train_like_one_process_in_bf16() -> None:
    """bf16 under pipeline x shard (FSDP2's MixedPrecisionPolicy per stage) against one process in bf16."""
    with torch.random.fork_rng():
        reference = pipeline_workers.train(None, "1f1b", "names", precision="bf16")
    ranks = harness.run(
        pipeline_workers.train,
        world_size=4,
        timeout=240,
        layout="pipeline=2,shard=2",
        kind="1f1b",
        split="names",
        precision="bf16",
    )
    for r in ranks:  # bf16's 8-bit mantissa shows the other summation order at ~1e-3
        assert r["loss"] == pytest.approx(reference["loss"], rel=1e-2)


# Refused on every rank before any message: one launch, the process group usable throughout.
ALIKE = ["empty_split", "batch_of_10", "batch_of_3"]


def test_what_can_be_checked_before_the_schedule_is_refused_on_every_rank_alike() -> None:
    ranks = harness.run(pipeline_workers.failures, world_size=2, timeout=120, cases=ALIKE)
    for r in ranks:
        assert r["empty_split"].startswith("PrepareError: split names ['']"), r
        for rows in (10, 3):
            said = r[f"batch_of_{rows}"]
            assert said.startswith("ArgumentValueError: forward_backward splits the batch into 4")
            assert f"inputs[0] has {rows} row(s)" in said
    assert ranks[0] == ranks[1]


# (case, the rank that fails or dies, what its own error says; None: it dies)
ONE_RANK = [
    ("non_scalar_loss", 1, "UsageError: the loss function given to forward_backward returned a tensor"),
    ("forward_raises", 0, "[Stage 0] failed to run forward"),
    ("killed_mid_step", 1, None),
]


@pytest.mark.parametrize(("case", "failed", "own"), ONE_RANK)
def test_a_rank_failing_inside_the_schedule_is_named_on_the_other(
    case: str, failed: int, own: str | None
) -> None:
    """The rank that raised keeps its own error; the one waiting on it gets RankFailedError naming it."""
    lost = (failed,) if own is None else ()
    ranks = harness.run(pipeline_workers.failures, world_size=2, timeout=120, lost=lost, cases=[case])
    survivor = ranks[1 - failed][case]
    assert survivor.startswith("RankFailedError: forward_backward() in the pipeline schedule on rank")
    if own is None:
        assert f"lost rank(s) [{failed}]" in survivor
    else:
        assert own in ranks[failed][case], ranks[failed][case]
        assert f"rank(s) [{failed}] failed while this rank waited" in survivor
        assert own in survivor  # the failed rank's own error, told to this one
