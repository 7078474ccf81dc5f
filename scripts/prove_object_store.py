"""The long proof of hundreds of SIGKILLs of a checkpoint writer on object storage.

    PYTHONPATH=. python scripts/prove_object_store.py [kills] [seed] [worlds] [formats]
    # default: 200 kills per format, seed 0, worlds "1,2" (one writer process, then two gloo
    # ranks), formats "whole,sharded"

Starts moto's S3 server on a free port of 127.0.0.1 (dummy credentials, set for
this process only), makes a bucket, and runs the kill loops of
tests/test_object_store.py for the whole-tensor and the sharded format:

* one writer (``tests/distributed/object_store_workers.crash_trials``): forked
  writers checkpoint step after step with ``keep=2``, each SIGKILLed at a random
  moment drawn from the measured duration of one write;
* two gloo ranks (``two_rank_crash_trials``): per trial two forked ranks form a
  group and checkpoint step after step with ``keep=2``; rank 0, rank 1 or both
  are SIGKILLed at a random moment drawn from the measured duration of one
  two-rank write (a single victim's peer a random moment later); after each
  kill every committed checkpoint left must restore whole at its own step, and at
  the end one unkilled write must leave nothing but committed checkpoints.

After each kill the latest checkpoint must restore whole (every tensor, value
and generator of one step: a mix of two would show). Prints one JSON line per
world and format (and, at two ranks, one line per kill on stderr) and exits 1 on
any broken or mixed checkpoint. The suite runs the same loops with a few kills.

The format ``leases`` (``python scripts/prove_object_store.py 200 0 1 leases``) races
writers for one root's lease instead: per round two processes take and release
the lease as fast as they can, ``kills`` takes in all, each holder marking a
local file with ``O_EXCL`` while it holds the lease and asking the store whether
its lease still stands before it lets go. Two holders at once, or a lease taken
over from its live holder, is counted, and exits 1 (the attack of the fourth run
found 5 in 160; the suite's bounded version of the interleavings is
``tests/test_object_store_roots.py::test_a_live_writers_lease_is_never_taken_over``).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from typing import Any


def run_format(env: dict[str, str], root: str, ranks: int, sharded: bool, kills: int, seed: int) -> dict:
    """The kill loop for one format at 1 or 2 writer ranks; its figures (or the error) as a dict."""
    from tests.distributed import harness
    from tests.distributed import object_store_workers as ow

    fn = ow.crash_trials if ranks == 1 else ow.two_rank_crash_trials
    start = time.perf_counter()
    figures: dict = {"ranks": ranks, "format": "sharded" if sharded else "whole"}
    try:
        (result,) = harness.run(
            fn,
            world_size=1,
            timeout=120 + 30 * kills,
            env=env,
            root=root,
            trials=kills,
            delay_in_writes=3.0,
            seed=seed,
            sharded=sharded,
            **({} if ranks == 1 else {"progress": True}),
        )
    except Exception as error:  # a restore that failed or mixed raised in the helper
        return {**figures, "error": str(error)[-3000:]}
    outcomes = result["outcomes"]
    if ranks == 1:
        mid_write = sum(checked == committed for committed, checked in outcomes)
    else:
        mid_write = result["killed_mid_write"]
        figures["killed_ranks"] = result["killed_ranks"]
        figures["modes"] = {m: sum(o[2] == i for o in outcomes) for i, m in enumerate(("0", "1", "both"))}
        figures["orphan_cleaned"] = result["orphan_cleaned"]
    return {
        **figures,
        "kills": len(outcomes),
        "broken_or_mixed": 0,  # each restore checked every tensor; one bad raises
        "killed_mid_write": mid_write,
        "last_step": result.get("latest", outcomes[-1][1] if outcomes else None),
        "left_in_root": result["left"],
        "seconds": round(time.perf_counter() - start),
    }


def _lease_worker(env: dict[str, str], root: str, marker: str, takes: int, seed: int, out: Any) -> None:
    """One writer of the lease race: ``takes`` attempts; what it held, was refused, saw overlap."""
    import random

    os.environ.update(env)
    from faccel._storage._roots import spot_of
    from faccel.errors import CheckpointError

    spot, chance = spot_of(root), random.Random(seed)
    held = refused = overlaps = 0
    for _ in range(takes):
        try:
            with spot.store.lock(spot.key) as lease:
                try:
                    fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:  # the other writer holds it too
                    overlaps += 1
                    continue
                time.sleep(chance.uniform(0, 0.01))
                overlaps += spot.store.check_lock(lease) is not None  # taken over while held
                os.close(fd)
                os.unlink(marker)
                held += 1
        except CheckpointError:
            refused += 1
        time.sleep(chance.uniform(0, 0.02))  # so that either writer gets its turns
    out.put((held, refused, overlaps))


def run_leases(env: dict[str, str], root: str, takes: int, seed: int) -> dict:
    """The lease race: rounds of two writer processes, ``takes`` lease takes in all."""
    import multiprocessing
    import tempfile

    context = multiprocessing.get_context("spawn")
    start, rounds = time.perf_counter(), max(1, takes // 80)
    totals = [0, 0, 0]
    for number in range(rounds):
        marker = os.path.join(tempfile.mkdtemp(), "held")
        queue = context.Queue()
        each = max(1, takes // (2 * rounds))
        workers = [
            context.Process(
                target=_lease_worker,
                args=(env, f"{root}/round-{number}", marker, each, seed * 1000 + 2 * number + side, queue),
            )
            for side in (0, 1)
        ]
        for worker in workers:
            worker.start()
        for _ in workers:
            totals = [a + b for a, b in zip(totals, queue.get(timeout=600), strict=True)]
        for worker in workers:
            worker.join()
    held, refused, overlaps = totals
    figures = {"format": "leases", "takes": held + refused, "held": held, "refused": refused}
    figures |= {"taken_from_a_live_writer": overlaps, "seconds": round(time.perf_counter() - start)}
    return figures if not overlaps else {**figures, "error": f"{overlaps} leases held twice"}


def main(
    kills: int, seed: int, worlds: tuple[int, ...] = (1, 2), formats: tuple[str, ...] = ("whole", "sharded")
) -> None:
    import logging

    import s3fs
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
    os.environ.update(env)
    bucket = f"prove-{secrets.token_hex(4)}"
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir(bucket)
    failed = False
    try:
        if "leases" in formats:
            result = run_leases(env, f"s3://{bucket}/leases", kills, seed)
            print(json.dumps(result), flush=True)
            failed = "error" in result
        for ranks in worlds:
            for sharded in [name == "sharded" for name in formats if name != "leases"]:
                result = run_format(
                    env,
                    f"s3://{bucket}/r{ranks}-{'sharded' if sharded else 'whole'}",
                    ranks,
                    sharded,
                    kills,
                    seed,
                )
                print(json.dumps(result), flush=True)
                failed = failed or "error" in result
    finally:
        server.stop()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main(
        int(sys.argv[1]) if len(sys.argv) > 1 else 200,
        int(sys.argv[2]) if len(sys.argv) > 2 else 0,
        tuple(int(w) for w in sys.argv[3].split(",")) if len(sys.argv) > 3 else (1, 2),
        tuple(sys.argv[4].split(",")) if len(sys.argv) > 4 else ("whole", "sharded"),
    )
