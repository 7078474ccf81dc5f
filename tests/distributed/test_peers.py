"""Hung and missing peers end in a named error within the timeout, and a job ends cleanly.

Two real gloo processes; each rank's outcome (error type, message, seconds waited)
comes back from tests/distributed/peer_workers.py, so no test can hang past the
harness's own short timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import harness, peer_workers

ROOT = Path(__file__).resolve().parents[2]


# (collective, the rank that waits for the hung one)
@pytest.mark.parametrize(
    ("collective", "waiter"),
    [("reduce", 0), ("broadcast", 0), ("wait_for_everyone", 0), ("main_process_first", 1)],
)
def test_a_hung_rank_ends_in_an_error_naming_the_collective(collective: str, waiter: int) -> None:
    # Before: wait_for_everyone and main_process_first raised gloo's bare RuntimeError
    # ("Timed out waiting 2000ms for recv operation"), after torch's 30 minutes by default.
    timeout_s, sleep_s = 2.0, 5.0
    outcome = harness.run(
        peer_workers.hung_rank, timeout=30, collective=collective, timeout_s=timeout_s, sleep_s=sleep_s
    )[waiter]
    assert outcome["error"] == "DistributedError", outcome
    assert outcome["message"].startswith(
        f"{collective}() on rank {waiter} of 2 timed out after 0:00:02: another rank did not reach "
        f"{collective}() in time"
    )
    assert "faccel.detect(timeout=...) or FACCEL_TIMEOUT=<seconds>" in outcome["message"]
    # The timeout ended it (the message names it), not the sleeper: had rank 1 woken and arrived
    # first, the collective would have answered and there would be no error.
    assert timeout_s - 0.5 < outcome["seconds"]


def test_a_hung_rank_is_named_with_its_last_call_and_step(tmp_path: Path) -> None:
    # Before: "gather() on rank 0 of 2 timed out ... another rank did not reach gather()": which
    # rank, and what it was doing, were left to the reader of every rank's log.
    outcome = harness.run(
        peer_workers.skipped_collective, timeout=60, root=str(tmp_path), timeout_s=2.0, sleep_s=5.0
    )[0]
    assert outcome["error"] == "DistributedError", outcome
    message = outcome["message"]
    assert message.startswith("gather() on rank 0 of 2 timed out after 0:00:02")
    assert (
        "The ranks that did not arrive at this gather() (this rank's collective #4): rank 1 (its "
        "last faccel call: reduce() (its collective #3), at step 3, after 3 backward calls)."
    ) in message, message


def test_the_train_timeout_applies_once_training_has_warmed_up() -> None:
    # The set-up timeout (30 s) would let the hung rank wake first; the train_timeout (2 s),
    # applied from the second step on, ends the wait long before.
    outcome = harness.run(
        peer_workers.hung_after_warm_up, timeout=60, timeout_s=30.0, train_timeout_s=2.0, sleep_s=8.0
    )[0]
    assert outcome["error"] == "DistributedError", outcome
    assert outcome["message"].startswith("reduce() on rank 0 of 2 timed out after 0:00:02"), outcome
    # The train timeout ended it (the message says 2 s), not the sleeper: had rank 1 woken first,
    # its reduce would have answered and there would be no error at all.
    assert outcome["seconds"] > 1.5


def test_an_evaluation_of_a_sharded_model_on_the_main_process_only_is_named() -> None:
    # Before: rank 0's lone forward paired its all-gathers with rank 1's training step:
    # a bare gloo RuntimeError after the timeout, or gloo's "EnforceNotMet ... preamble.length"
    # and SIGABRT when the shapes differed (nanoGPT's estimate_loss under `if master_process`).
    main, other = harness.run(peer_workers.fsdp_eval_on_main_only, timeout=30, timeout_s=2.0)
    assert main["error"] == "DistributedError", main
    assert main["message"].startswith(
        "a forward of the sharded (FSDP2) Blocks without gradients on rank 0 of 2 waited 0:00:02 "
        "for the other ranks to run one too, and they did not"
    )
    assert "every rank must run every forward, evaluation included" in main["message"]
    assert "Rank 1 failed to pass monitoredBarrier" in main["message"]  # names the missing rank
    assert main["seconds"] > 1.5  # the 2 s wait the message names
    assert other["error"] is not None  # its training forward waits for rank 0 in vain, then fails


def test_an_evaluation_of_a_sharded_model_on_every_rank_works() -> None:
    main, other = harness.run(peer_workers.fsdp_eval_on_every_rank, timeout=60)
    assert main["losses"] == other["losses"] and len(main["losses"]) == 3


def test_a_torchrun_script_without_shutdown_stops_its_group_at_exit() -> None:
    script = ROOT / "tests" / "distributed" / "scripts" / "no_shutdown.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*command, str(script)],
        capture_output=True,
        text=True,
        timeout=90,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    # Both ranks write to one pipe, so their lines may interleave: look for each report anywhere.
    reports = sorted(re.findall(r"rank (\d): process group running at exit: (\w+)", done.stdout))
    assert reports == [("0", "False"), ("1", "False")], done.stdout
    assert "terminate called" not in output


def test_a_peer_gone_before_a_checkpoint_ends_within_the_process_groups_timeout(tmp_path: Path) -> None:
    # Before: the survivor waited the fixed 60 s arrival_timeout though the job's timeout was
    # shorter, and the message only blamed an `if dist.is_main_process:` guard.
    timeout_s = 3.0
    survivor, _ = harness.run(
        peer_workers.peer_gone_before_checkpoint, timeout=60, root=str(tmp_path), timeout_s=timeout_s
    )
    assert survivor["error"] == "CheckpointError", survivor
    assert "rank(s) [1] did not call it within 0:00:03" in survivor["message"]
    assert "crashed, was killed or left" in survivor["message"]
    assert timeout_s - 0.5 < survivor["seconds"]  # the job's timeout (named above) ended it, not the 60 s


def test_a_peer_gone_at_the_agreement_step_is_the_callers_named_error() -> None:
    # the ranks' agreement (an all_reduce after the check-in) raised the
    # backend's bare RuntimeError when a peer was gone; now it is the caller's error, naming the step.
    survivor, _ = harness.run(peer_workers.peer_gone_at_the_agreement, timeout=60, timeout_s=3.0)
    assert survivor["error"] == "CheckpointError", survivor
    assert survivor["message"].startswith("the checkpoint's agreement: rank 0 waited for the other ranks")
    assert "or lost one of them" in survivor["message"]


def test_a_survivor_whose_store_host_died_gets_a_named_error(tmp_path: Path) -> None:
    # without a torchrun agent rank 0 hosts the store; when it died, the
    # survivor's next faccel call raised torch's raw DistNetworkError.
    import socket

    with socket.socket() as probe:  # a free port for rank 0's store (released before rank 0 binds it)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = ROOT / "tests" / "distributed" / "scripts" / "store_host_dies.py"
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2"}
    base |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCAL_WORLD_SIZE": "2"}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "ckpt")],
            env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )
        for rank in (0, 1)
    ]
    outputs = [job.communicate(timeout=600)[0] for job in ranks]  # only a hang reaches the limit
    line = next((text for text in outputs[1].splitlines() if text.startswith("rank 1: ")), outputs[1])
    assert line.startswith("rank 1: CheckpointError: checkpoint() on rank 1: the rendezvous store at "), line
    assert "has probably died" in line and "Restart the job from the latest checkpoint" in line


def test_a_longer_evaluation_on_one_rank_is_named_when_the_others_train_again() -> None:
    # Both ranks evaluate, rank 0 one batch more: rank 1's first training forward checks in and
    # waits for rank 0, which is still evaluating; before the check-in at this change of kind,
    # rank 0's third evaluation all-gathers paired silently with rank 1's training ones.
    main, other = harness.run(peer_workers.fsdp_eval_uneven, timeout=30, timeout_s=2.0)
    assert other["error"] == "DistributedError", other
    assert other["message"].startswith(
        "a forward of the sharded (FSDP2) Blocks with gradients on rank 1 of 2 waited 0:00:02 for the "
        "other ranks to end their forwards without gradients too, and they did not"
    ), other
    assert "even_batches=True" in other["message"]
    assert main["error"] is not None  # its third evaluation forward waits for rank 1 in vain


def test_forwards_of_one_kind_in_a_row_enter_no_collective_and_shutdown_removes_the_hooks() -> None:
    # a check-in before every forward without gradients made an evaluation forward
    # 52x the hand-written one; now the ranks meet only where the forwards change kind.
    outcomes = harness.run(peer_workers.fsdp_check_ins, timeout=60)
    for outcome in outcomes:
        # train x2 (no check-in), evaluate x3 (one), train x2 (one), evaluate x4 (one), x1 more (none)
        assert outcome["phases"] == [0, 1, 1, 1, 0], outcome
        # the check-in and the optimizer's rebind-at-first-step; the rebind removed itself at the step
        assert outcome["held"] == {"after prepare": 2, "after the first step": 1}, outcome
        assert outcome["hooks removed"] == 1 and outcome["left"] == [0, 0], outcome
