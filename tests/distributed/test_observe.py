"""Two gloo ranks with a meter: a slow rank is named with its host and local rank; a rank that
stops before a collective is named, with what it was doing, in the error of the rank that waited."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from tests.distributed import harness, observe_workers


def test_a_rank_that_sleeps_in_its_step_is_named_as_the_straggler(tmp_path: Path) -> None:
    ranks = harness.run(observe_workers.slow_rank, timeout=90, root=str(tmp_path), every=4)
    for rank in ranks:  # every rank gets the same answer, and the sleeper alone is named
        assert rank["named"] == [[1, rank["host"], 1]], rank
        assert rank["steps"] == 8 and rank["items_per_second"] > 0 and rank["memory"] > 0
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {name for record in records for name in record["metrics"]}
    assert {"perf/items_per_second", "perf/step_seconds", "memory/peak_gib", "step_time/max"} <= logged
    assert {"stragglers/count": 1.0}.items() <= records[-1]["metrics"].items()


def test_a_rank_that_stops_before_a_collective_is_named_with_its_phase(tmp_path: Path) -> None:
    waiter, _ = harness.run(observe_workers.stopped_rank, timeout=90, root=str(tmp_path))
    assert waiter["error"] == "DistributedError", waiter
    message, timeout = waiter["message"], datetime.timedelta(seconds=waiter["timeout"])
    # The timeout is twenty of this machine's steps; rank 0 waited that long, then was told.
    assert message.startswith(f"check_stragglers() on rank 0 of 2 timed out after {timeout}:"), message
    assert waiter["waited"] >= waiter["timeout"] * 0.9, waiter
    assert f"rank 1 (host {waiter['host']}, local rank 1): in backward after check_stragglers()" in message
    assert str(tmp_path / "hangs") in message  # where the records are, for whoever reads the run later
    assert waiter["own_state"] == "timed out in check_stragglers"
    stopped = json.loads((tmp_path / "hangs" / "rank-00001.json").read_text())
    assert stopped["phase"] == "backward" and stopped["state"] == "running"
