"""Three replicas that keep training while one is killed and restarted: healed from a live peer.

python examples/fault_tolerant.py                   # the demonstration: lighthouse, 3 replicas, a kill
python examples/fault_tolerant.py --quorum-every 8  # the same, asking for a quorum every 8 steps

The demonstration starts torchft's lighthouse and three replicas of this script
(``--replica R``), each its own process running the same fault-tolerant loop; it
SIGKILLs replica 2 mid-run and starts it again at once. The other two never stop
stepping (their quorum shrinks to 2); the restarted one receives the weights, the
AdamW state, the step and the data position from a live peer (no checkpoint exists
here) and rejoins the quorum. At the end every replica prints a digest of its
weights: the three are equal. On a cluster, start the lighthouse once
(``torchft_lighthouse --min_replicas 1 --bind [::]:29510``) and each replica with
``--replica R --lighthouse http://HOST:29510`` under your scheduler, which restarts it.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys

import torch
from torch import nn

import faccel

SAMPLES, BATCH, REPLICAS = 512, 16, 3


def replica(number: int, lighthouse: str, steps: int, quorum_every: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    state = faccel.TrainState.create(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3))
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, 16, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True).sin()
    dist = faccel.detect(seed=0)
    ft = faccel.fault_tolerant(
        dist,
        state,
        replica=number,
        lighthouse=lighthouse,
        dataset_size=SAMPLES,
        batch_size=BATCH,
        quorum_every=quorum_every,  # 1: a quorum every step; more: every that many steps
    )
    # A job ends at `steps`. This demonstration goes on past it until all three replicas are in
    # the quorum again, so that it ends with all three (the survivors can reach `steps` before the
    # restarted replica is back): the members of a quorum see the same count at the same step,
    # so they stop together.
    participants = 0
    while state.step < steps or participants < REPLICAS:
        quorum = faccel.replica_quorum(ft, state)  # a replica behind heals here
        if quorum.healed:
            print(f"replica {number}: healed from a live peer at step {quorum.state.step}", flush=True)
        rows = list(quorum.indices)  # this replica's share of the step's samples
        if rows:
            loss = nn.functional.mse_loss(model(inputs[rows]), targets[rows])
            loss.backward()
        state = faccel.replica_commit(ft, quorum)  # the step, or nothing if a replica failed in it
        participants = quorum.participants
        if state.step % 100 == 0 and state.step > quorum.state.step:
            print(f"replica {number}: step {state.step}, {quorum.participants} replicas", flush=True)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters()))
    print(f"replica {number}: done at step {state.step}, weights {digest.hexdigest()[:16]}", flush=True)
    faccel.shutdown(dist)


def demonstrate(steps: int, quorum_every: int) -> None:
    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers: warnings only
    from torchft._torchft import LighthouseServer

    # A join timeout as torchft_lighthouse's default (60 s; this server's own is 100 ms): with
    # --quorum-every, a restarted replica waits for the others' next quorum, and a short join
    # timeout would let the first of them form a quorum without the rest.
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=60_000
    )
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]

    def start(number: int, **options: object) -> subprocess.Popen[str]:
        command = [sys.executable, __file__, "--replica", str(number), "--lighthouse", address]
        command += ["--steps", str(steps), "--quorum-every", str(quorum_every)]
        return subprocess.Popen(command, text=True, **options)  # type: ignore[call-overload]

    procs = [start(0), start(1), start(2, stdout=subprocess.PIPE)]
    for line in procs[2].stdout or ():  # replica 2 trains a while (its own lines), then dies
        print(line, end="", flush=True)
        if "step 300," in line:
            break
    procs[2].send_signal(signal.SIGKILL)
    procs[2].wait()
    print("replica 2: killed; starting it again", flush=True)
    procs[2] = start(2)
    codes = [proc.wait() for proc in procs]
    lighthouse.shutdown()
    if any(codes):
        raise SystemExit(f"a replica failed: exit codes {codes}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replica", type=int)
    parser.add_argument("--lighthouse")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--quorum-every", type=int, default=1)
    args = parser.parse_args()
    if args.replica is None:
        demonstrate(args.steps, args.quorum_every)
    else:
        replica(args.replica, args.lighthouse, args.steps, args.quorum_every)
