"""What the object-storage tests run in worker processes: each first points s3fs at the test's server.

Workers come from a forkserver started before the test set its environment, so
every function takes the environment (endpoint, dummy credentials) and sets it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any

import torch

from tests.distributed import checkpoint_workers as cw
from tests.distributed import sharded_workers as sw
from tests.object_store import use


def save(env: Mapping[str, str], root: str, strategy: str, sharded: bool | None, steps: int = 3) -> dict:
    """Train Blocks + AdamW on every rank, checkpoint into ``root`` (a URL): the global state, the objects."""
    import attrs

    import faccel

    use(env)
    dist = faccel.detect(strategy=strategy)
    model, optimizer = sw._trained(dist, steps)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    folder = faccel.checkpoint(dist, attrs.evolve(state, step=steps, epoch=1), root, sharded=sharded)
    import fsspec

    fs, key = fsspec.core.url_to_fs(str(folder))
    fs.invalidate_cache()
    return {
        "state": sw.global_state(model, optimizer),
        "objects": sorted(p.rsplit("/", 1)[1] for p in fs.ls(key)),
    }


def load(env: Mapping[str, str], root: str, strategy: str) -> dict:
    """Fresh Blocks + AdamW restored from ``root``: the global state."""
    use(env)
    return sw.load(root, strategy)


def crash_trials(
    env: Mapping[str, str], root: str, trials: int, delay_in_writes: float, seed: int, sharded: bool = False
) -> dict[str, Any]:
    """Fork writers that checkpoint step after step into ``root``; SIGKILL each at a random moment;
    restore. ``[committed, restored]`` per trial; raises if a restore fails or mixes two checkpoints."""
    import faccel

    use(env)
    dist = faccel.detect({})
    state = cw.crash_state(0)
    faccel.checkpoint(dist, cw.at_step(state, 0, mark=0), root, sharded=sharded)
    faccel.checkpoint(dist, state, f"{root}-warmup", sharded=sharded)  # one-time costs, before any kill

    def write(mark: int) -> None:
        faccel.checkpoint(dist, cw.at_step(state, mark), root, keep=2, sharded=sharded)

    torch.set_num_threads(1)
    outcomes = cw.kill_loop(
        write, lambda: cw.crash_check(root), trials=trials, delay_in_writes=delay_in_writes, seed=seed
    )
    # What the kills left: at most one uncommitted step prefix beyond the committed ones, never a
    # committed one without all of its objects (the restores above checked each).
    import fsspec

    fs, key = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    return {"outcomes": outcomes, "left": sorted(p.rsplit("/", 1)[1] for p in fs.ls(key)), "pid": os.getpid()}


def _committed_folders(root: str) -> list[tuple[int, str]]:
    """``(step, URL)`` of every committed checkpoint under ``root`` (a folder with its manifest)."""
    import fsspec

    import faccel

    fs, key = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    found = []
    for path in sorted(fs.ls(key)):
        name = path.rsplit("/", 1)[1]
        if name.startswith("step-") and faccel.latest_checkpoint(f"{root}/{name}") is not None:
            found.append((int(name.removeprefix("step-")), f"{root}/{name}"))
    return found


def two_rank_crash_trials(
    env: Mapping[str, str],
    root: str,
    trials: int,
    delay_in_writes: float,
    seed: int,
    sharded: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Two real gloo ranks checkpoint step after step into ``root``; SIGKILL one or both at random moments.

    Runs in a one-thread helper process: per trial it hosts a fresh ``TCPStore`` and forks two
    writer ranks (which inherit the built state and warmed-up code), waits until their group
    is up, sleeps a random delay drawn from ``[0, delay_in_writes * w]`` (``w``: the measured
    duration of one two-rank write, re-measured from every trial's writers, never a fixed number
    of seconds), then SIGKILLs rank 0, rank 1 or both; a single victim's peer is SIGKILLed a
    random moment later (within ``w``), unless it ended itself first. After each kill: the
    latest checkpoint restores whole at the last committed step or the next, and every committed
    checkpoint left in ``root`` restores whole at its own step. At the end one unkilled two-rank
    write must leave only committed checkpoints (``keep=2``): the kills' orphans are gone.
    ``outcomes``: ``[committed, restored, mode]`` per trial (mode 0/1: that rank first, 2: both).
    ``progress``: one JSON line per trial on stderr (the long proof's running count).
    """
    import itertools
    import mmap
    import random
    import signal
    import struct
    import time
    from datetime import timedelta

    import attrs
    import torch.distributed as tdist

    import faccel

    use(env)
    torch.set_num_threads(1)
    state = cw.crash_state(0)
    dist1 = faccel.detect({})
    faccel.checkpoint(dist1, attrs.evolve(cw.at_step(state, 0), position=0), root, sharded=sharded)
    # shared with the forked ranks: rank 0's group-ready time, last committed step, its commit time
    shared = mmap.mmap(-1, 24)
    chooser = random.Random(seed)

    def rank_body(rank: int, port: int, first: int, count: float) -> None:
        os.environ.update(
            {
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "TORCHELASTIC_USE_AGENT_STORE": "True",
            }
        )
        dist = faccel.detect(timeout=timedelta(seconds=60))
        if rank == 0:
            struct.pack_into("<d", shared, 0, time.monotonic())
        for step in itertools.count(first):
            if step - first >= count:
                break
            # at an epoch boundary (position 0): restorable at 1 rank, where the checks run
            boundary = attrs.evolve(cw.at_step(state, step), position=0)
            faccel.checkpoint(dist, boundary, root, keep=2, sharded=sharded)
            if rank == 0:  # the time, then the step: a kill between them never pairs a new step with 0.0
                struct.pack_into("<d", shared, 16, time.monotonic())
                struct.pack_into("<q", shared, 8, step)
        tdist.destroy_process_group()

    def start(latest: int, count: float, first: int | None = None) -> tuple[Any, list[int]]:
        first = latest + 1 if first is None else first
        struct.pack_into("<dqd", shared, 0, 0.0, latest, 0.0)
        store = tdist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        pids = [cw._fork(lambda r=rank: rank_body(r, store.port, first, count)) for rank in range(2)]
        return store, pids

    def ready(pids: list[int]) -> float:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            (at,) = struct.unpack_from("<d", shared, 0)
            if at:
                return at
            time.sleep(0.01)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
            cw._wait(pid)
        raise AssertionError("the two ranks did not start their group")

    def pace(latest_at_fork: int, ready_at: float) -> tuple[int, float]:
        committed, last = struct.unpack_from("<qd", shared, 8)
        done = committed - latest_at_fork
        if done > 0 and last > ready_at:
            return committed, (last - ready_at) / done
        return committed, time.monotonic() - ready_at

    # one unkilled two-rank write measures the pace the kills are scaled to
    latest = 0
    store, pids = start(latest, 1)
    ready_at = ready(pids)
    assert [cw._wait(pid) for pid in pids] == [0, 0]
    latest, write_time = pace(latest, ready_at)
    del store
    outcomes, mid_write, killed_ranks = [], 0, 0
    for _ in range(trials):
        latest_at_fork = latest
        store, pids = start(latest, float("inf"))
        ready_at = ready(pids)
        time.sleep(chooser.uniform(0, delay_in_writes * write_time))
        mode = chooser.randrange(3)
        if mode == 2:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        else:
            os.kill(pids[mode], signal.SIGKILL)
            time.sleep(chooser.uniform(0, write_time))
            os.kill(pids[1 - mode], signal.SIGKILL)  # a zombie already, if it ended itself
        codes = [cw._wait(pid) for pid in pids]
        killed_ranks += sum(code == -signal.SIGKILL for code in codes)
        del store
        committed, measured = pace(latest_at_fork, ready_at)
        write_time = measured if committed > latest_at_fork else max(write_time, measured)
        restored = cw.crash_check(root, at_boundary=True)
        assert committed <= restored <= committed + 1, (committed, restored)
        folders = _committed_folders(root)
        for step, folder in folders:  # no committed checkpoint was damaged by the kill
            assert cw.crash_check(folder, step, at_boundary=True, into=f"{root}-elsewhere") == step
        # the step after the latest committed one had begun: objects of it without a manifest
        mid_write += any(name == f"step-{restored + 1:012d}" for name in _names(root))
        outcomes.append([committed, restored, mode])
        if progress:
            import json
            import sys

            line = {"root": root, "kill": len(outcomes), "committed": committed, "restored": restored}
            print(json.dumps({**line, "mode": mode, "mid_write": mid_write}), file=sys.stderr, flush=True)
        latest = max(committed, restored)
    # the next successful checkpoint (a step further, as a restarted job that skipped one would
    # write) cleans what the kills left: the orphan of step latest + 1, if the last kill left one
    orphan = f"step-{latest + 1:012d}" in _names(root)
    for _ in range(10):  # if the last kill left none, kill a writer once its first object is up
        if orphan:
            break
        latest_at_fork = latest
        store, pids = start(latest, 1)
        ready(pids)
        began = f"step-{latest + 1:012d}"
        while began not in _names(root) and struct.unpack_from("<q", shared, 8)[0] == latest_at_fork:
            time.sleep(0.005)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)  # a zombie already, if it ended itself
        for pid in pids:
            cw._wait(pid)
        del store
        latest = cw.crash_check(root, at_boundary=True)
        orphan = f"step-{latest + 1:012d}" in _names(root)
    store, pids = start(latest, 1, first=latest + 2)
    ready(pids)
    assert [cw._wait(pid) for pid in pids] == [0, 0]
    del store
    committed = _committed_folders(root)
    left = _names(root)
    assert [step for step, _ in committed] == [latest, latest + 2], (committed, left)
    assert [name for name in left if name.startswith("step-")] == [
        f"step-{s:012d}" for s in (latest, latest + 2)
    ]
    return {
        "outcomes": outcomes,
        "killed_mid_write": mid_write,
        "killed_ranks": killed_ranks,
        "left": left,
        "orphan_cleaned": orphan,
        "latest": latest,
        "write_seconds": write_time,
    }


def _names(root: str) -> list[str]:
    import fsspec

    fs, key = fsspec.core.url_to_fs(root)
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(key))


def fault_on_one_rank(env: Mapping[str, str], root: str, how: str, sharded: bool) -> dict[str, Any]:
    """Two ranks commit step 1 into ``root``; then, during step 2, rank 1's store fails for good:
    ``how="503"``: every upload of rank 1 answers 503 SlowDown; ``how="unreachable"``: rank 1's
    server is gone before its first request (its endpoint now a closed port of 127.0.0.1);
    ``how="stopped"``: rank 1 reaches the server through a TCP relay of its own, which stops (every
    connection cut, the port closed) once rank 1 has uploaded its first object of step 2: the
    server gone mid-upload. What each rank raised, and the step and marks a restore at both ranks
    (the store back) then reads."""
    import socket

    import attrs
    import fsspec

    import faccel
    from faccel._storage import _objects
    from faccel._storage._roots import spot_of

    use(env)
    relay = None
    if how == "stopped" and os.environ["RANK"] == "1":
        relay = _Relay(int(env["AWS_ENDPOINT_URL"].rsplit(":", 1)[1]))
        _point_at(relay.port)
    dist = faccel.detect()
    state = cw.crash_state(0)
    faccel.checkpoint(dist, attrs.evolve(cw.at_step(state, 1), position=0), root, sharded=sharded)
    _objects._FIRST_WAIT = 0.001  # type: ignore[attr-defined]  # a short backoff: few, fast retries
    _objects.ATTEMPTS = 2  # type: ignore[attr-defined]
    undo: list[Any] = []
    if dist.rank == 1:
        if how == "503":
            fs = spot_of(root).store.fs  # fsspec's cached instance: the one faccel uses

            def slow_down(*args: Any, **kwargs: Any) -> Any:
                raise OSError(503, "SlowDown: please reduce your request rate")

            real = fs.pipe_file
            fs.pipe_file = slow_down
            undo.append(lambda: setattr(fs, "pipe_file", real))
        elif relay is not None:
            real_upload = _objects.ObjectStore._upload
            uploaded = []

            def stop_mid_upload(self: Any, key: str, *args: Any, **kwargs: Any) -> Any:
                if "step-000000000002/" in key:
                    uploaded.append(key)
                    if len(uploaded) == 2:  # the first object is up: the server goes away
                        relay.stop()
                return real_upload(self, key, *args, **kwargs)

            _objects.ObjectStore._upload = stop_mid_upload  # type: ignore[method-assign]
            undo.append(lambda: setattr(_objects.ObjectStore, "_upload", real_upload))
            undo.append(lambda: (use(env), fsspec.filesystem("s3").clear_instance_cache()))
        else:
            with socket.socket() as probe:  # a port nothing listens on
                probe.bind(("127.0.0.1", 0))
                dead = probe.getsockname()[1]
            _point_at(dead)
            undo.append(lambda: (use(env), fsspec.filesystem("s3").clear_instance_cache()))
    raised = None
    try:
        faccel.checkpoint(dist, attrs.evolve(cw.at_step(state, 2), position=0), root, sharded=sharded)
    except Exception as error:  # every rank must get the named error, none may hang
        raised = {"type": f"{type(error).__module__}.{type(error).__name__}", "message": str(error)}
    for step in undo:
        step()
    target = cw.crash_state(0)
    target = faccel.TrainState.create(
        model=target.model, optimizer=target.optimizer, extras={"step": None, "tensor": torch.zeros(16)}
    )
    try:
        restored = faccel.restore(dist, target, root)
    except Exception as error:
        return {"raised": raised, "restore_error": str(error)}
    tensors = [
        *faccel.unwrap_model(restored.model).state_dict().values(),
        *(entry["momentum_buffer"] for entry in restored.optimizer.state.values()),
        restored.extras["tensor"],
    ]
    marks = sorted({float(value) for t in tensors for value in t.unique().tolist()})
    return {
        "raised": raised,
        "restored": restored.step,
        "marks": marks,
        "extras": restored.extras["step"],
        "uploaded_before_the_stop": None if relay is None else relay.stopped_after,
    }


def _point_at(port: int) -> None:
    """This process's S3 client at 127.0.0.1:``port``, with its own retries off (faccel's bounded
    ones count)."""
    import fsspec
    import s3fs

    s3fs.S3FileSystem.retries = 1
    os.environ.update(
        {
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
            "AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{port}",
            "AWS_MAX_ATTEMPTS": "1",
        }
    )
    fsspec.filesystem("s3").clear_instance_cache()


class _Relay:
    """A TCP relay on a free port of 127.0.0.1 to a local server's ``port``; ``stop()`` cuts every
    connection and closes the port (new connections are refused): the server gone, seen from here."""

    def __init__(self, port: int) -> None:
        import socket
        import threading

        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections: list[Any] = []
        self.stopped_after: int | None = None
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.connections += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(source: Any, sink: Any) -> None:
        import socket

        try:
            while data := source.recv(1 << 16):
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        import socket

        with self.lock:
            self.stopped_after = len(self.connections) // 2
            for sock in [self.listener, *self.connections]:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()


def deepspeed_stop_and_resume(env: Mapping[str, str], root: str, stage: int) -> dict[str, Any]:
    """tests/distributed/deepspeed_workers.stop_and_resume with its checkpoints in ``root`` (a URL)."""
    from tests.distributed import deepspeed_workers

    use(env)
    return deepspeed_workers.stop_and_resume(stage=stage, root=root)


def peer_lost_after_the_commit(env: Mapping[str, str], root: str) -> dict[str, Any]:
    """Rank 1 ends its process at the meeting after rank 0's commit of step 2 (a SIGKILL there, as
    the kill loop's one survivor in 16 met it): what rank 0 is told, and what the root holds."""
    import attrs

    import faccel
    from faccel._checkpoint import _save

    use(env)
    dist = faccel.detect()
    model = torch.nn.Linear(2, 2)
    state = faccel.TrainState.create(model=model, optimizer=None)
    faccel.checkpoint(dist, attrs.evolve(state, step=1), root)
    if dist.rank == 1:
        real = _save.together

        def gone(dist: Any, work: Any, *, what: str, raises: Any) -> Any:
            if what.startswith("committing"):
                os._exit(0)  # the peer dies where rank 0 has committed and waits for it
            return real(dist, work, what=what, raises=raises)

        _save.together = gone  # type: ignore[assignment]  # this child process only
    try:
        faccel.checkpoint(dist, attrs.evolve(state, step=2), root)
        error = ""
    except faccel.errors.CheckpointError as caught:
        error = str(caught)
    latest = faccel.latest_checkpoint(root)
    return {"error": error, "latest": str(latest)}
