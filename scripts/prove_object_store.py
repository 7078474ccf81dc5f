"""The long proof of issue 33: hundreds of SIGKILLs of a checkpoint writer on object storage.

    PYTHONPATH=. python scripts/prove_object_store.py [kills] [seed]   # default 200 kills per format

Starts moto's S3 server on a free port of 127.0.0.1 (dummy credentials, set for
this process only), makes a bucket, and runs the kill loop of
tests/test_object_store.py (``tests/distributed/object_store_workers.crash_trials``)
for the whole-tensor and the sharded format: forked writers checkpoint step
after step with ``keep=2``, each SIGKILLed at a random moment drawn from the
measured duration of one write; after each kill the latest checkpoint must
restore whole (every tensor, value and generator of one step: a mix of two
would show). Prints one JSON line per format and exits 1 on any broken or
mixed checkpoint. The suite runs the same loop with a few kills.
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time


def main(kills: int, seed: int) -> None:
    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    from tests.distributed import harness
    from tests.distributed import object_store_workers as ow

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
        for sharded in (False, True):
            start = time.perf_counter()
            try:
                (result,) = harness.run(
                    ow.crash_trials,
                    world_size=1,
                    timeout=60 + 20 * kills,
                    env=env,
                    root=f"s3://{bucket}/{'sharded' if sharded else 'whole'}",
                    trials=kills,
                    delay_in_writes=3.0,
                    seed=seed,
                    sharded=sharded,
                )
            except Exception as error:  # a restore that failed or mixed raised in the helper
                print(json.dumps({"sharded": sharded, "error": str(error)[-3000:]}))
                failed = True
                continue
            outcomes = result["outcomes"]
            mid_write = sum(checked == committed for committed, checked in outcomes)
            print(
                json.dumps(
                    {
                        "format": "sharded" if sharded else "whole",
                        "kills": len(outcomes),
                        "broken_or_mixed": 0,  # each restore checked every tensor; one bad raises
                        "killed_mid_write": mid_write,
                        "last_step": outcomes[-1][1] if outcomes else None,
                        "left_in_root": result["left"],
                        "seconds": round(time.perf_counter() - start),
                    }
                )
            )
    finally:
        server.stop()
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200, int(sys.argv[2]) if len(sys.argv) > 2 else 0)
