"""Fault-tolerant replicas on real processes: the worker each replica runs, and the replay.

A replica trains a small MLP on a synthetic dataset through ``fault_tolerant``,
``replica_quorum`` and ``replica_commit``, and appends one JSON line per committed
step to ``out/replica-R.jsonl`` (the quorum, the samples read, a digest of the weights
the step started from), and one per heal; at the end it writes its final weights. The
parent kills and restarts replicas between lines; :func:`replay` computes, in one
process, the weights the committed quorums must have produced.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

FEATURES = 8
# How many steps the gate stays ahead of the furthest replica.
_AHEAD = 6


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.01)


def dataset(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1234)
    x = torch.randn(size, FEATURES, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def grads_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, indices: list[int]) -> None:
    if indices:
        rows = torch.tensor(indices, dtype=torch.long)
        torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()


def digest(model: torch.nn.Module) -> str:
    hasher = hashlib.sha256()
    for tensor in model.state_dict().values():
        hasher.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def read_gate(out: str) -> tuple[int, bool]:
    """The parent's gate: the step no replica may begin past, and whether the run ends there."""
    text = (Path(out) / "gate").read_text().split()
    return int(text[0]), len(text) > 1


def write_gate(out: str, step: int, *, stop: bool = False) -> None:
    path = Path(out) / "gate"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{step} stop" if stop else str(step))
    tmp.replace(path)


def replica_main(
    *, replica: int, lighthouse: str, out: str, dataset_size: int, batch_size: int, quorum_every: int = 1
) -> None:
    """One replica's whole run; restarted as is after a kill (it heals from a live peer).

    The replicas step until the parent's gate says stop; the gate (a step number the parent
    keeps ahead of the replicas) is what makes every replica end at the same step.
    """
    import time

    import faccel
    from faccel._ft._replicas import fault_tolerant, replica_commit, replica_quorum

    torch.set_num_threads(1)
    dist = faccel.detect(seed=7)
    model = make_model()
    state = faccel.TrainState.create(model=model, optimizer=make_optimizer(model))
    x, y = dataset(dataset_size)
    ft = fault_tolerant(
        dist,
        state,
        replica=replica,
        lighthouse=lighthouse,
        dataset_size=dataset_size,
        batch_size=batch_size,
        host="127.0.0.1",
        quorum_every=quorum_every,
    )
    log = Path(out) / f"replica-{replica}.jsonl"
    (Path(out) / f"ready-{replica}").write_text(str(os.getpid()))
    with log.open("a") as lines:
        while True:
            gate, stop = read_gate(out)
            while state.step >= gate and not stop:
                time.sleep(0.001)
                gate, stop = read_gate(out)
            if state.step >= gate:
                break
            quorum = replica_quorum(ft, state)
            if quorum.fresh and os.environ.get("FT_DEBUG"):
                print(
                    "QUORUM",
                    replica,
                    quorum.state.step,
                    quorum.quorum_id,
                    quorum.participants,
                    quorum.failed,
                    time.time(),
                    flush=True,
                )
            before = digest(model)
            if quorum.healed:
                lines.write(
                    json.dumps({"heal": quorum.state.step, "weights": before, "pid": os.getpid()}) + "\n"
                )
                lines.flush()
            grads_of(model, x, y, list(quorum.indices))
            state = replica_commit(ft, quorum)
            if state.step == quorum.state.step and os.environ.get("FT_DEBUG"):
                print("DISCARD", replica, repr(ft.manager.errored()), flush=True)
            if state.step > quorum.state.step:
                record = {
                    "step": quorum.state.step,
                    "participants": quorum.participants,
                    "rank": quorum.replica_rank,
                    "fresh": quorum.fresh,
                    "epoch": quorum.rows.epoch,
                    "consumed": quorum.state.consumed,
                    "indices": list(quorum.indices),
                    "weights": before,
                    "pid": os.getpid(),
                    "time": time.time(),
                }
                lines.write(json.dumps(record) + "\n")
                lines.flush()
    final = {name: t.detach().clone() for name, t in model.state_dict().items()}
    from safetensors.torch import save_file

    save_file(final, str(Path(out) / f"final-{replica}.safetensors"))
    faccel.shutdown(dist)


def records(out: str, replicas: int) -> list[list[dict[str, Any]]]:
    """Each replica's lines, in order."""
    result = []
    for replica in range(replicas):
        path = Path(out) / f"replica-{replica}.jsonl"
        text = path.read_text() if path.exists() else ""
        # The last piece is a line still being written (or empty): only whole lines count.
        result.append([json.loads(line) for line in text.split("\n")[:-1] if line.strip()])
    return result


def replay(
    steps: list[dict[str, Any]], *, dataset_size: int, batch_size: int, seed: int = 7
) -> dict[str, torch.Tensor]:
    """The weights after the committed steps (one record each, in order), computed in this process."""
    from faccel._ft._combine import flat_grads
    from faccel._ft._replicas import apply_step
    from faccel._ft._rows import epoch_order, replica_rows, sample_counts
    from faccel._train_state import TrainState

    torch.set_num_threads(1)
    model = make_model()
    state = TrainState.create(model=model, optimizer=make_optimizer(model))
    x, y = dataset(dataset_size)
    params = list(model.parameters())
    for record in steps:
        participants, epoch, consumed = record["participants"], record["epoch"], record["consumed"]
        order = epoch_order(seed, epoch, dataset_size)
        grads = []
        for rank in range(participants):
            rows = replica_rows(
                epoch=epoch,
                consumed=consumed,
                dataset_size=dataset_size,
                batch_size=batch_size,
                replica_rank=rank,
                participants=participants,
            )
            for p in params:
                p.grad = None
            grads_of(model, x, y, order[rows.start : rows.stop].tolist())
            grads.append(flat_grads(params))
        counts = sample_counts(
            consumed=consumed, dataset_size=dataset_size, batch_size=batch_size, participants=participants
        )
        apply_step(state, grads, tuple(counts))
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _committed(lines: list[dict[str, Any]]) -> int:
    return sum(1 for line in lines if "step" in line)


def kill_run(
    *,
    kills: int,
    seed: int,
    out: str,
    replicas: int = 3,
    dataset_size: int = 96,
    batch_size: int = 4,
    timeout: float = 300,
    quorum_every: int = 1,
) -> dict[str, Any]:
    """Run ``replicas`` replicas, SIGKILL one at a random step ``kills`` times and restart it, then stop.

    Which replica dies and after how many of its own committed steps are drawn from ``seed``;
    the next kill waits until the restarted replica has healed and committed a step, so each
    kill meets a full quorum. No wall-clock wait: the parent polls the replicas' lines and
    keeps the gate a few steps ahead of them. Returns the kills, the last step, exit codes.
    """
    import multiprocessing as mp
    import random
    import time

    # torchft's servers log every quorum at INFO (megabytes a minute): warnings only. Set
    # before torchft's first import, which reads it.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    rng = random.Random(seed)
    # join_timeout_ms as torchft_lighthouse's own default (60 s; the Python server's is 100 ms): a
    # restarted replica waits at the lighthouse for the others' next quorum (up to quorum_every
    # steps), and with 100 ms the first of them to come would form a quorum without the rest.
    # A dead replica is not waited for: it stops heartbeating (1 s here) and no longer counts.
    lighthouse = LighthouseServer(
        bind="127.0.0.1:0", min_replicas=2, heartbeat_timeout_ms=1000, join_timeout_ms=60_000
    )
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "faccel", "torchft", "tests.distributed.ft_workers"])
    kwargs = {
        "lighthouse": address,
        "out": out,
        "dataset_size": dataset_size,
        "batch_size": batch_size,
        "quorum_every": quorum_every,
    }
    write_gate(out, 0)

    def top() -> int:
        seen = records(out, replicas)
        return max((line["step"] + 1 for lines in seen for line in lines if "step" in line), default=0)

    def poll() -> None:
        write_gate(out, top() + _AHEAD)
        time.sleep(0.002)

    def start(replica: int) -> Any:
        proc = ctx.Process(target=replica_main, kwargs={"replica": replica, **kwargs})
        proc.start()
        return proc

    procs = {replica: start(replica) for replica in range(replicas)}
    done: dict[int, list[int]] = {replica: [] for replica in range(replicas)}
    killed: list[dict[str, int]] = []
    deadline = time.monotonic() + timeout
    try:
        # Every replica joins before the first step, so the first quorum has them all.
        while not all((Path(out) / f"ready-{r}").exists() for r in range(replicas)):
            if time.monotonic() > deadline:
                raise AssertionError("the replicas did not start")
            time.sleep(0.002)
        for _ in range(kills):
            victim = rng.randrange(replicas)
            seen = records(out, replicas)
            at = _committed(seen[victim]) + rng.randrange(1, 4)
            while _committed(records(out, replicas)[victim]) < at:
                if procs[victim].exitcode is not None or time.monotonic() > deadline:
                    break
                poll()
            lines = records(out, replicas)[victim]
            step = max((line["step"] for line in lines if "step" in line), default=0)
            if procs[victim].exitcode is not None or time.monotonic() > deadline:
                break
            killed_at = time.time()
            procs[victim].kill()
            procs[victim].join()
            done[victim].append(procs[victim].exitcode)
            killed.append({"replica": victim, "after_step": step, "time": killed_at})
            before = len(lines)
            procs[victim] = start(victim)
            # The next kill waits for this replica to heal and commit: one failure at a time.
            while time.monotonic() < deadline:
                now = records(out, replicas)[victim]
                if any("heal" in line for line in now[before:]) and _committed(now[before:]) >= 1:
                    break
                if procs[victim].exitcode is not None:
                    break
                poll()
        last = top() + _AHEAD
        write_gate(out, last, stop=True)
        for replica, proc in procs.items():
            proc.join(max(deadline - time.monotonic(), 1))
            if proc.is_alive():
                proc.kill()
                proc.join()
            done[replica].append(proc.exitcode)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    return {"kills": killed, "exitcodes": done, "steps": last}


def check_run(
    out: str,
    run: dict[str, Any],
    *,
    replicas: int = 3,
    dataset_size: int = 96,
    batch_size: int = 4,
    quorum_every: int = 1,
) -> dict[str, Any]:
    """The run's laws, checked; returns figures for a report. Raises AssertionError on a broken one."""
    from safetensors.torch import load_file

    steps = run["steps"]
    lines = records(out, replicas)
    for replica, codes in run["exitcodes"].items():
        assert codes[-1] == 0, f"replica {replica} ended with {codes}"
    # One record per committed step, the same on every replica that committed it.
    by_step: dict[int, dict[str, Any]] = {}
    for replica_lines in lines:
        for line in replica_lines:
            if "step" not in line:
                continue
            key = {k: line[k] for k in ("participants", "epoch", "consumed", "weights", "fresh")}
            seen = by_step.setdefault(line["step"], key)
            assert seen == key, f"step {line['step']}: replicas disagree: {seen} vs {key}"
    assert sorted(by_step) == list(range(steps)), f"committed steps {sorted(by_step)}"
    # A quorum began at most every quorum_every committed steps: no longer run of steps without.
    fresh = [s for s in range(steps) if by_step[s]["fresh"]]
    assert fresh and fresh[0] == 0, f"the first step asked for no quorum: {fresh[:3]}"
    gaps = [b - a for a, b in zip(fresh, [*fresh[1:], steps], strict=True)]
    assert max(gaps) <= quorum_every, f"{max(gaps)} steps without a quorum, quorum_every={quorum_every}"
    # Survivors never stopped: a replica never killed committed every step, in one process.
    killed = {kill["replica"] for kill in run["kills"]}
    for replica in set(range(replicas)) - killed:
        mine = [line["step"] for line in lines[replica] if "step" in line]
        pids = {line["pid"] for line in lines[replica]}
        assert len(pids) == 1, f"replica {replica} was never killed yet ran as {pids}"
        assert mine == sorted(set(mine)), f"replica {replica} stepped out of order: {mine}"
    # Each heal gave the weights the live replicas had at that step, bit for bit.
    heals = [line for replica_lines in lines for line in replica_lines if "heal" in line]
    healed_later = [h for h in heals if h["heal"] > 0]
    for heal in healed_later:
        if heal["heal"] in by_step:
            assert heal["weights"] == by_step[heal["heal"]]["weights"], f"heal at {heal['heal']}"
    # Each sample of an epoch in exactly one committed step: the samples every rank of each
    # committed quorum read (a replica killed before it logged a step still read its share),
    # the logged ones equal to them.
    from faccel._ft._rows import epoch_order, replica_rows

    samples: dict[int, list[int]] = {}
    for step in range(steps):
        record = by_step[step]
        order = epoch_order(7, record["epoch"], dataset_size)
        for rank in range(record["participants"]):
            rows = replica_rows(
                epoch=record["epoch"],
                consumed=record["consumed"],
                dataset_size=dataset_size,
                batch_size=batch_size,
                replica_rank=rank,
                participants=record["participants"],
            )
            samples.setdefault(record["epoch"], []).extend(order[rows.start : rows.stop].tolist())
    for replica_lines in lines:
        for line in replica_lines:
            if "step" in line:
                record = by_step[line["step"]]
                order = epoch_order(7, record["epoch"], dataset_size)
                rows = replica_rows(
                    epoch=record["epoch"],
                    consumed=record["consumed"],
                    dataset_size=dataset_size,
                    batch_size=batch_size,
                    replica_rank=line["rank"],
                    participants=record["participants"],
                )
                assert line["indices"] == order[rows.start : rows.stop].tolist(), f"step {line['step']}"
    last_epoch = by_step[steps - 1]["epoch"]
    for epoch, got in samples.items():
        assert len(got) == len(set(got)), f"epoch {epoch}: a sample read twice"
        if epoch < last_epoch:
            assert sorted(got) == list(range(dataset_size)), f"epoch {epoch}: {len(got)} of {dataset_size}"
    # The final weights: equal on every replica, and equal to a replay of the committed quorums.
    finals = [load_file(str(Path(out) / f"final-{replica}.safetensors")) for replica in range(replicas)]
    expected = replay(
        [by_step[s] | {"step": s} for s in range(steps)], dataset_size=dataset_size, batch_size=batch_size
    )
    for replica, final in enumerate(finals):
        for name, tensor in expected.items():
            assert torch.equal(final[name], tensor), f"replica {replica}: {name} differs from the replay"
    return {
        "kills": len(run["kills"]),
        "heals": len(healed_later),
        "quorum_sizes": sorted({by_step[s]["participants"] for s in by_step}),
        "quorums": len(fresh),
        "epochs_complete": last_epoch,
        "steps": steps,
    }


def retry_main(
    *, replica: int, lighthouse: str, out: str, steps: int, quorum_timeout: float, quorum_retries: int
) -> None:
    """A replica whose quorum requests wait ``quorum_timeout`` seconds each; it writes what it saw.

    The first time it asks for a quorum again (faccel's warning), it writes ``retried-R``: the
    parent starts the peer only then, so that the retry is certain and no wait is timed.
    """
    import datetime
    import logging

    import faccel
    from faccel._ft._replicas import fault_tolerant, replica_commit, replica_quorum
    from faccel.errors import DistributedError

    class Mark(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            (Path(out) / f"retried-{replica}").touch()

    logging.getLogger("faccel.fault_tolerance").addHandler(Mark())
    torch.set_num_threads(1)
    dist = faccel.detect(seed=7)
    model = make_model()
    state = faccel.TrainState.create(model=model, optimizer=make_optimizer(model))
    x, y = dataset(96)
    ft = fault_tolerant(
        dist,
        state,
        replica=replica,
        lighthouse=lighthouse,
        dataset_size=96,
        batch_size=4,
        host="127.0.0.1",
        quorum_timeout=datetime.timedelta(seconds=quorum_timeout),
        quorum_retries=quorum_retries,
    )
    seen: dict[str, Any] = {"retries": [], "error": None}
    try:
        while state.step < steps:
            quorum = replica_quorum(ft, state)
            seen["retries"].append(quorum.retries)
            grads_of(model, x, y, list(quorum.indices))
            state = replica_commit(ft, quorum)
    except DistributedError as error:
        seen["error"] = str(error)
    seen["step"], seen["weights"] = state.step, digest(model)
    (Path(out) / f"result-{replica}.json").write_text(json.dumps(seen))
    faccel.shutdown(dist)


def _heartbeating(address: str) -> int:
    """How many replicas the lighthouse at ``address`` still hears from (its status page says)."""
    import re
    import urllib.request

    with urllib.request.urlopen(address + "/status", timeout=10) as page:
        text = page.read().decode()
    found = re.search(r"\[(\d+) heartbeating\]", text)
    assert found is not None, text
    return int(found.group(1))


def retry_run(*, out: str, timeout: float = 240) -> dict[int, dict[str, Any]]:
    """A replica alone asks for a quorum again and again (the lighthouse wants two); then its peer comes.

    Replica 9 asks with one retry only and gives up (``DistributedError``). Replica 0 asks with
    a short ``quorum_timeout`` and many retries; once it has retried, replica 1 starts, and the
    two train two steps together. Returns what each wrote.
    """
    import multiprocessing as mp
    import time

    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2, heartbeat_timeout_ms=1000)
    address = "http://127.0.0.1:" + lighthouse.address().rsplit(":", 1)[1]
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "faccel", "torchft", "tests.distributed.ft_workers"])
    # One request waits 0.5 s: it is meant to time out (no peer yet); how long it waits sets only
    # how long the test takes. 200 retries (100 s) is the bound on the peer's start, generous.
    common = {"lighthouse": address, "out": out, "steps": 2, "quorum_timeout": 0.5}

    def start(replica: int, retries: int) -> Any:
        proc = ctx.Process(
            target=retry_main, kwargs={"replica": replica, "quorum_retries": retries, **common}
        )
        proc.start()
        return proc

    deadline = time.monotonic() + timeout
    procs = []
    try:
        procs.append(start(9, 1))
        procs[-1].join(max(deadline - time.monotonic(), 1))
        # The lighthouse counts replica 9 until its heartbeat lapses (its own clock): a replica 0
        # that asked before then would form a quorum with the dead replica at once, not retry.
        while _heartbeating(address) and time.monotonic() < deadline:
            time.sleep(0.05)
        procs.append(start(0, 200))
        while not (Path(out) / "retried-0").exists() and procs[-1].exitcode is None:
            if time.monotonic() > deadline:
                raise AssertionError("replica 0 never asked for a quorum again")
            time.sleep(0.01)
        procs.append(start(1, 200))
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 1))
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        lighthouse.shutdown()
    return {
        replica: json.loads(path.read_text())
        for replica in (9, 0, 1)
        if (path := Path(out) / f"result-{replica}.json").exists()
    }
