"""Checkpoint test builders and the functions the two-process checkpoint tests run on every rank.

A *spec* (plain JSON, so hypothesis can draw it and the harness can pass it
to child processes) describes a small model, its optimizer, scheduler and
scaler, and the data. :func:`build` turns it into objects; :func:`train`
runs the loop, stopping before it fetches a batch it will not use;
:func:`resume_cases` checks that stopping, checkpointing and restoring into
fresh objects changes nothing, bit for bit.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

OPTIMIZERS = ("sgd", "adam", "adamw_amsgrad")
SCHEDULERS = (None, "step", "cosine", "onecycle", "lambda", "plateau")


def example_spec(**changes: Any) -> dict[str, Any]:
    """A spec with every feature on (ties, dropout, batch norm, a transposed parameter)."""
    spec: dict[str, Any] = {
        "width": 5,
        "depth": 2,
        "tied": True,
        "dropout": True,
        "batchnorm": True,
        "transposed": True,
        "optimizer": "adamw_amsgrad",
        "groups": 2,
        "scheduler": "onecycle",
        "scaler": True,
        "samples": 22,
        "batch_size": 4,
        "total_steps": 9,
    }
    spec.update(changes)
    return spec


class Net(nn.Module):
    """A small MLP with the features that make checkpoints hard."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__()
        width = spec["width"]
        self.inp = nn.Linear(4, width)
        self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(spec["depth"]))
        # Tied: a second layer sharing the first hidden layer's weight (one Parameter, two names).
        self.tied = nn.Linear(width, width) if spec["tied"] else None
        if self.tied is not None:
            self.tied.weight = self.hidden[0].weight
        self.norm = nn.BatchNorm1d(width) if spec["batchnorm"] else None
        self.drop = nn.Dropout(0.25) if spec["dropout"] else None
        # Transposed: a non-contiguous parameter (and, under Adam, non-contiguous state).
        self.proj = nn.Parameter(torch.randn(2, width).t() if spec["transposed"] else torch.randn(width, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for layer in self.hidden:
            h = torch.tanh(layer(h))
        if self.tied is not None:
            h = torch.tanh(self.tied(h))
        if self.norm is not None:
            h = self.norm(h)
        if self.drop is not None:
            h = self.drop(h)
        return (h @ self.proj).sum(dim=1, keepdim=True)


def lr_lambda(step: int) -> float:
    """LambdaLR's function (module level: the scheduler keeps code, the checkpoint does not)."""
    return 1.0 / (1.0 + 0.1 * step)


def build(spec: dict[str, Any], *, seed: int) -> tuple[nn.Module, Any, Any, Any]:
    """``(model, optimizer, scheduler, scaler)`` of ``spec``; ``seed`` sets the initial weights."""
    torch.manual_seed(seed)
    model = Net(spec)
    named = list(model.named_parameters())  # each tied Parameter once
    if spec["groups"] == 2:
        first = [p for n, p in named if n.startswith(("inp", "hidden"))]
        rest = [p for n, p in named if not n.startswith(("inp", "hidden"))]
        params: Any = [{"params": first}, {"params": rest, "lr": 0.02, "weight_decay": 0.0}]
    else:
        params = [p for _, p in named]
    kind = spec["optimizer"]
    if kind == "sgd":
        optimizer: Any = torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    elif kind == "adam":
        optimizer = torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.95))
    else:
        optimizer = torch.optim.AdamW(params, lr=0.01, amsgrad=True, weight_decay=0.1)
    scheduler = _scheduler(spec, optimizer)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=2) if spec["scaler"] else None
    return model, optimizer, scheduler, scaler


def _scheduler(spec: dict[str, Any], optimizer: Any) -> Any:
    kind = spec["scheduler"]
    schedulers = torch.optim.lr_scheduler
    if kind == "step":
        return schedulers.StepLR(optimizer, step_size=2, gamma=0.5)
    if kind == "cosine":
        return schedulers.CosineAnnealingLR(optimizer, T_max=5)
    if kind == "onecycle":
        return schedulers.OneCycleLR(optimizer, max_lr=0.05, total_steps=spec["total_steps"] + 5)
    if kind == "lambda":
        return schedulers.LambdaLR(optimizer, lr_lambda)
    if kind == "plateau":
        return schedulers.ReduceLROnPlateau(optimizer, patience=1, factor=0.5)
    return None


def data(spec: dict[str, Any]) -> torch.utils.data.DataLoader:
    """The spec's regression data as a shuffling DataLoader (prepare shards it)."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(spec["samples"], 4, generator=g)
    y = torch.randn(spec["samples"], 1, generator=g)
    # Batch norm cannot train on a batch of one sample: drop the last, short batch then.
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=spec["batch_size"],
        shuffle=True,
        drop_last=spec["batchnorm"],
    )


def seed_generators(rank: int, base: int) -> None:
    """Each rank's Python, NumPy and torch generators, distinct per rank."""
    random.seed(base + rank)
    np.random.seed(base + 10 + rank)
    torch.manual_seed(base + 20 + rank)


def fresh(
    dist: Any, spec: dict[str, Any], *, seed: int, extras: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """A prepared ``(TrainState, loader)`` for ``spec`` at step 0."""
    import faccel

    model, optimizer, scheduler, scaler = build(spec, seed=seed)
    model, optimizer, loader = faccel.prepare(dist, model, optimizer, data(spec))
    state = faccel.TrainState.create(
        model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler, extras=extras
    )
    return state, loader


def train(dist: Any, state: Any, loader: Any, *, until: int) -> Any:
    """Train from ``state`` until ``state.step == until``, resuming the loader where it stopped.

    Uses all three random generators (dropout and noise: torch; loss weights:
    Python and NumPy), so a resume is exact only if all three are restored.
    A batch is fetched only when it will be used.
    """
    import attrs

    import faccel

    model, optimizer, scheduler, scaler = state.model, state.optimizer, state.scheduler, state.scaler
    if len(loader) == 0:
        msg = "the loader has no batch on this rank: the loop would never end"
        raise ValueError(msg)
    batches = iter(loader.at(epoch=state.epoch, start=state.position))
    while state.step < until:
        try:
            inputs, targets = next(batches)
        except StopIteration:
            state = attrs.evolve(state, epoch=state.epoch + 1, position=0)
            batches = iter(loader.at(epoch=state.epoch))
            continue
        optimizer.zero_grad()
        inputs = inputs + 0.01 * torch.randn_like(inputs)
        weight = 1.0 + 0.1 * random.random() + 0.1 * float(np.random.rand())
        loss = weight * nn.functional.mse_loss(model(inputs), targets)
        if scaler is not None:
            faccel.backward(dist, scaler.scale(loss))
            scaler.step(optimizer)
            scaler.update()
        else:
            faccel.backward(dist, loss)
            optimizer.step()
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            metric = loss.detach().clone()
            if dist.distributed:  # the same metric on every rank, or the ranks' LRs would part
                torch.distributed.all_reduce(metric)
            scheduler.step(metric.item())
        elif scheduler is not None:
            scheduler.step()
        state = attrs.evolve(state, step=state.step + 1, position=state.position + 1)
    return state


def digest(state: Any, *, buffers: bool = True) -> str:
    """SHA-256 of every bit of the model and optimizer state (what 'bitwise equal' compares).

    ``buffers=False`` leaves out the model's buffers: under DDP a checkpoint
    holds rank 0's, which DDP broadcasts before every forward anyway, so the
    other ranks' own (stale) running statistics are not part of the law.
    """
    import faccel

    h = hashlib.sha256()
    model = faccel.unwrap_model(state.model)
    names = {name for name, _ in model.named_buffers()} if not buffers else set()
    for name, tensor in model.state_dict().items():
        if name in names:
            continue
        h.update(name.encode())
        h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    for pid, entry in sorted(state.optimizer.state_dict()["state"].items()):
        for key, value in sorted(entry.items()):
            h.update(f"{pid}.{key}".encode())
            if isinstance(value, torch.Tensor):
                h.update(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(value).encode())
    h.update(repr(state.optimizer.state_dict()["param_groups"]).encode())
    return h.hexdigest()


def resume_cases(
    spec: dict[str, Any], stops: list[int], root: str, env: dict[str, str] | None = None
) -> dict:
    """For each stop: train to it, checkpoint, restore into fresh objects, train on.

    Returns the uninterrupted run's digest and each resumed run's, and the
    step, epoch and position each restore returned.
    """
    import faccel

    torch.use_deterministic_algorithms(True)
    dist = faccel.detect(env)
    total = spec["total_steps"]
    state, loader = fresh(dist, spec, seed=0)
    seed_generators(dist.rank, 100)
    # Buffers only where the checkpoint holds this rank's own (see digest).
    own_buffers = dist.rank == 0
    reference = digest(train(dist, state, loader, until=total), buffers=own_buffers)
    resumed: dict[str, Any] = {}
    for stop in stops:
        state, loader = fresh(dist, spec, seed=0)
        seed_generators(dist.rank, 100)
        state = train(dist, state, loader, until=stop)
        folder = os.path.join(root, f"stop{stop}")
        faccel.checkpoint(dist, state, folder, keep=1)
        seed_generators(dist.rank, 999)  # a new process would start from other states
        target, loader = fresh(dist, spec, seed=1)
        restored = faccel.restore(dist, target, folder)
        position = [restored.step, restored.epoch, restored.position]
        expected = [state.step, state.epoch, state.position]
        final = train(dist, restored, loader, until=total)
        resumed[str(stop)] = {
            "digest": digest(final, buffers=own_buffers),
            "restored": position,
            "expected": expected,
        }
    return {"rank": dist.rank, "reference": reference, "resumed": resumed}


def save_model_then_read(directory: str, max_shard_size: int) -> dict:
    """Every rank saves (rank 0 writes); right after, every rank lists and loads the files."""
    import faccel

    dist = faccel.detect()
    model, _, _, _ = build(example_spec(), seed=0)
    faccel.save_model(dist, model, directory, max_shard_size=max_shard_size)
    listed = sorted(os.listdir(directory))  # complete here on every rank: save_model is a barrier
    target, _, _, _ = build(example_spec(), seed=1)
    faccel.load_model(dist, target, directory)
    equal = all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), target.state_dict().values(), strict=True)
    )
    return {"rank": dist.rank, "files": listed, "equal": equal}


def checkpoint_layout(root: str, until: int = 3, epoch_end: bool = False) -> dict:
    """Checkpoint under DDP; report which files exist and this rank's torch RNG digest.

    ``epoch_end``: the loop has finished the epoch and says so (next epoch, batch 0).
    """
    import attrs

    import faccel

    dist = faccel.detect()
    spec = example_spec()
    state, loader = fresh(dist, spec, seed=0)
    seed_generators(dist.rank, 100)
    state = train(dist, state, loader, until=until)
    if epoch_end:
        assert state.position == len(loader)
        state = attrs.evolve(state, epoch=state.epoch + 1, position=0)
    folder = faccel.checkpoint(dist, state, root)
    listed = sorted(os.listdir(folder))  # visible to every rank once checkpoint returns
    expected_rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    torch.manual_seed(12345)
    target, _ = fresh(dist, spec, seed=1)
    faccel.restore(dist, target, root)
    got_rng = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()
    return {"rank": dist.rank, "files": listed, "rng": expected_rng, "restored_rng": got_rng}


def mismatched_steps(root: str) -> dict:
    """Ranks pass different steps: every rank must raise (no hang, nothing committed)."""
    import attrs

    import faccel

    dist = faccel.detect()
    state, _ = fresh(dist, example_spec(), seed=0)
    try:
        faccel.checkpoint(dist, attrs.evolve(state, step=dist.rank), root)
    except faccel.errors.CheckpointError as error:
        return {"rank": dist.rank, "error": str(error), "listed": sorted(os.listdir(root))}
    return {"rank": dist.rank, "error": None, "listed": sorted(os.listdir(root))}


def one_rank_fails(root: str) -> dict:
    """Rank 1 restores into a wrong model: both ranks raise CheckpointError, none loads."""
    import faccel

    dist = faccel.detect()
    spec = example_spec()
    state, _ = fresh(dist, spec, seed=0)
    faccel.checkpoint(dist, state, root)
    # Unprepared targets: DDP itself would refuse (or wait on) different shapes across ranks.
    model, optimizer, scheduler, scaler = build(example_spec(width=6) if dist.rank == 1 else spec, seed=1)
    target = faccel.TrainState.create(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    before = digest(target)
    try:
        faccel.restore(dist, target, root)
    except faccel.errors.CheckpointError as error:
        return {"rank": dist.rank, "error": str(error), "unchanged": digest(target) == before}
    return {"rank": dist.rank, "error": None, "unchanged": digest(target) == before}


def assert_same(a: Any, b: Any, path: str = "value") -> None:
    """Strict equality: same types (a tuple is not a list), tensors and floats bit for bit."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (
        f"{path}: {type(a).__name__} != {type(b).__name__}"
    )
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{path}: {a.dtype} {a.shape} != {b.dtype} {b.shape}"
        bits_a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        bits_b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"{path}: tensors differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (
            f"{path}: arrays differ"
        )
    elif isinstance(a, float):
        assert np.float64(a).tobytes() == np.float64(b).tobytes(), f"{path}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert list(a) == list(b) or set(a) == set(b), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, dict):
        return {key: _copy(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_copy(item) for item in value)
    return value


def observe(state: Any) -> dict[str, Any]:
    """A deep copy of everything a checkpoint holds (objects' states, values, generators)."""
    import faccel

    extras = {
        name: _copy(value.state_dict() if hasattr(value, "load_state_dict") else value)
        for name, value in state.extras.items()
    }
    return {
        "model": _copy(dict(faccel.unwrap_model(state.model).state_dict())),
        "optimizer": _copy(state.optimizer.state_dict()),
        "scheduler": None if state.scheduler is None else _copy(state.scheduler.state_dict()),
        "scaler": None if state.scaler is None else _copy(state.scaler.state_dict()),
        "values": [state.step, state.epoch, state.position],
        "extras": extras,
        "python": random.getstate(),
        "numpy": _copy(np.random.get_state(legacy=False)),
        "torch": torch.get_rng_state(),
    }


# --- crash safety: a writer killed with SIGKILL (tests/test_checkpoint_crash.py) ---


def crash_state(step: int) -> Any:
    """A small TrainState in which every tensor, value and the torch generator say ``step``."""
    import faccel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 64)).sum().backward()
    optimizer.step()  # creates the momentum buffers
    state = faccel.TrainState.create(model=model, optimizer=optimizer, extras={"tensor": torch.zeros(16)})
    return at_step(state, step)


def at_step(state: Any, step: int, mark: int | None = None) -> Any:
    """``state`` at ``step``, with every tensor filled with ``mark`` (in place; ``step`` by
    default), and its epoch, position, extras and generator at ``mark``: two versions of one
    step (``replace=True``) differ by their mark."""
    import attrs

    mark = step if mark is None else mark
    with torch.no_grad():
        for tensor in state.model.parameters():
            tensor.fill_(mark)
        for entry in state.optimizer.state.values():
            entry["momentum_buffer"].fill_(mark)
        state.extras["tensor"].fill_(mark)
    torch.manual_seed(mark)
    extras = {"step": mark, "tensor": state.extras["tensor"]}
    return attrs.evolve(state, step=step, epoch=mark, position=mark, extras=extras)


def crash_check(
    root: str, step: int | None = None, at_boundary: bool = False, into: str | None = None
) -> int:
    """Restore the latest checkpoint under ``root`` into fresh objects; return its mark if whole.

    The checkpoint must be at ``step`` when given, else at its mark. ``at_boundary``: it was
    written with position 0 (an epoch boundary: restorable at another world size). ``into``:
    restore's ``into`` (reading an older checkpoint of a root that holds later ones).
    """
    import faccel

    target = crash_state(0)
    target = faccel.TrainState.create(
        model=target.model, optimizer=target.optimizer, extras={"step": None, "tensor": torch.zeros(16)}
    )
    restored = faccel.restore(faccel.detect({}), target, root, into=into)
    mark = restored.epoch
    assert restored.step == (mark if step is None else step), (restored.step, mark)
    step = mark
    position = 0 if at_boundary else step
    assert [restored.epoch, restored.position, restored.extras["step"]] == [step, position, step]
    tensors = [
        *faccel.unwrap_model(restored.model).state_dict().values(),
        *(entry["momentum_buffer"] for entry in restored.optimizer.state.values()),
        restored.extras["tensor"],
    ]
    assert all(bool((t == step).all()) for t in tensors), f"a mix of checkpoints around step {step}"
    expected_rng = torch.Generator().manual_seed(step).get_state()
    assert torch.equal(torch.get_rng_state(), expected_rng), f"generator of another step than {step}"
    return step


def _fork(body: Any) -> int:
    """Run ``body()`` in a forked child that never returns into the caller's code."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    return pid


def _wait(pid: int) -> int:
    """The child's exit code, or minus the signal that killed it."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


REPLACED_STEP = 5


def kill_loop(write: Any, check: Any, *, trials: int, delay_in_writes: float, seed: int) -> list[list[int]]:
    """Fork writers of versions ``latest + 1, latest + 2, ...``; SIGKILL each at a random moment; check.

    ``write(version)`` writes one version, whole; ``check()`` reads what is
    there and returns its version (at the start, the version already written).
    Run from a one-thread process: a fork inherits the built state and the
    warmed-up code, so a trial costs the kill delay and one check, not a
    process start. Returns ``[committed, checked]`` per trial: the last version
    the killed writer had finished, and what ``check()`` returned after the kill.

    The kill delay is drawn from ``[0, delay_in_writes * w]``, where ``w`` is the
    duration of one write measured here, never a fixed number of seconds: first
    one unkilled write in a forked writer, then, after every trial, the killed
    writer's own pace (its time to its last commit over its commits; when it
    committed nothing, at least the time it ran). A machine that slows down
    mid-run slows the kills with it.
    """
    import mmap
    import signal
    import struct
    import time

    # anonymous and shared with forked children: the last committed version and the
    # monotonic time of that commit
    shared = mmap.mmap(-1, 16)
    chooser = random.Random(seed)
    latest, outcomes = check(), []

    def body(first: int, count: float) -> None:
        for version in itertools.count(first):
            if version - first >= count:
                return
            write(version)
            # The time first, then the version: a SIGKILL between the two stores (or inside one
            # 16-byte store) leaves an older version with a newer time, never a new version with
            # the time the parent reset, which made the pace negative (a CI failure, 2026-12-04).
            struct.pack_into("<d", shared, 8, time.monotonic())
            struct.pack_into("<q", shared, 0, version)

    def pace(forked_at: float) -> tuple[int, float]:
        """The writer's last commit and its duration per write; both from the shared page."""
        committed, last = struct.unpack_from("<qd", shared, 0)
        done = committed - latest_at_fork
        if done > 0 and last > forked_at:
            return committed, (last - forked_at) / done
        return committed, time.monotonic() - forked_at  # a lower bound: it had not finished one

    # one unkilled write, fork included, measures the speed the kills are scaled to
    latest_at_fork = latest
    struct.pack_into("<qd", shared, 0, latest, 0.0)
    forked_at = time.monotonic()
    pid = _fork(lambda: body(latest + 1, 1))
    assert _wait(pid) == 0
    latest, write_time = pace(forked_at)
    for _ in range(trials):
        latest_at_fork = latest
        struct.pack_into("<qd", shared, 0, latest, 0.0)
        forked_at = time.monotonic()
        pid = _fork(lambda first=latest + 1: body(first, float("inf")))
        time.sleep(chooser.uniform(0, delay_in_writes * write_time))
        os.kill(pid, signal.SIGKILL)
        assert _wait(pid) == -signal.SIGKILL
        committed, measured = pace(forked_at)
        # a writer that finished nothing ran at most this long: the estimate only grows from it
        write_time = measured if committed > latest_at_fork else max(write_time, measured)
        checked = check()
        outcomes.append([committed, checked])
        latest = max(committed, checked)
    return outcomes


def crash_trials(root: str, trials: int, delay_in_writes: float, seed: int, replace: bool = False) -> dict:
    """Fork writers that checkpoint step after step; SIGKILL each at a random moment; restore.

    ``replace``: the writers rewrite one step (``REPLACED_STEP``) again and again with
    ``replace=True, keep=1``, each version with the next mark: the restored checkpoint must
    be a whole version, the last committed one or the next.

    Runs in a one-thread helper process (the harness's); see :func:`kill_loop`.
    Returns ``[committed, restored]`` per trial; raises if a restore fails or mixes.
    """
    import faccel

    dist = faccel.detect({})
    state = crash_state(0)
    fixed = REPLACED_STEP if replace else None
    faccel.checkpoint(dist, at_step(state, fixed or 0, mark=0), root)
    faccel.checkpoint(dist, state, os.path.join(root, ".warmup"))  # one-time costs, before any kill

    def write(mark: int) -> None:
        if fixed is None:
            faccel.checkpoint(dist, at_step(state, mark), root, keep=2)
        else:
            faccel.checkpoint(dist, at_step(state, fixed, mark), root, keep=1, replace=True)

    outcomes = kill_loop(
        write, lambda: crash_check(root, fixed), trials=trials, delay_in_writes=delay_in_writes, seed=seed
    )
    return {"outcomes": outcomes}


def kill_at_every_operation(root: str, replace: bool = False, sharded: bool = False) -> dict:
    """Checkpoint step 3 over steps 1 and 2 (keep=2), SIGKILLed at its 1st, 2nd, ... file operation.

    Operations: ``os.open``, ``os.write``, ``os.fsync``, ``os.mkdir``,
    ``os.rename``, ``os.replace`` and ``shutil.rmtree``. Returns the number
    of operations and the step restored after each kill.

    ``replace``: instead, step 2 alone (mark 2) is replaced by step 2 mark 102 with
    ``keep=1, replace=True``; after each kill the mark restored is reported, and the
    write is retried (what a restarted job does) and must give mark 102.
    ``sharded``: every checkpoint in the sharded format (version 2).
    """
    import shutil
    import signal

    import faccel

    dist = faccel.detect({})
    state = crash_state(0)
    faccel.checkpoint(dist, state, os.path.join(root, ".warmup"), sharded=sharded)

    def reset() -> None:
        for name in os.listdir(root):
            if name == ".lock":  # a killed writer's lock file (the OS released the lock itself)
                os.remove(os.path.join(root, name))
            elif name != ".warmup":
                shutil.rmtree(os.path.join(root, name))
        for step in (2,) if replace else (1, 2):
            faccel.checkpoint(dist, at_step(state, step), root, sharded=sharded)

    def write() -> None:
        if replace:
            faccel.checkpoint(dist, at_step(state, 2, mark=102), root, keep=1, replace=True, sharded=sharded)
        else:
            faccel.checkpoint(dist, at_step(state, 3), root, keep=2, sharded=sharded)

    def write_and_die_at(kill_at: int) -> None:
        patched = [(os, "fsync"), (os, "rename"), (os, "replace"), (os, "mkdir"), (os, "open"), (os, "write")]
        die_at_operation(kill_at, [*patched, (shutil, "rmtree")], write, os.path.join(root, "..", "count"))

    reset()
    assert _wait(_fork(lambda: write_and_die_at(0))) == 0
    with open(os.path.join(root, "..", "count")) as handle:
        total = int(handle.read())
    restored, retried = [], []
    for kill_at in range(1, total + 1):
        reset()
        assert _wait(_fork(lambda k=kill_at: write_and_die_at(k))) == -signal.SIGKILL
        restored.append(crash_check(root, 2 if replace else None))
        if replace:
            write()
            retried.append(crash_check(root, 2))
            assert sorted(n for n in os.listdir(root) if n != ".warmup") == ["step-000000000002"]
    return {"operations": total, "restored": restored, "retried": retried}


def restore_at_another_world_size(root: str) -> dict:
    """A DDP run restoring, at another world size, a mid-epoch checkpoint saved without its loader."""
    import faccel

    dist = faccel.detect()
    state, _ = fresh(dist, example_spec(), seed=1)
    before = [p.detach().clone() for p in state.model.parameters()]
    try:
        faccel.restore(dist, state, root)
    except faccel.errors.CheckpointError as error:
        unchanged = all(torch.equal(a, b) for a, b in zip(before, state.model.parameters(), strict=True))
        return {"rank": dist.rank, "error": str(error), "unchanged": unchanged}
    return {"rank": dist.rank, "error": None, "unchanged": None}


# --- mistakes under DDP: per-rank extras, calls on some ranks only, slow writes ---


def rank_extras(root: str) -> dict:
    """Rank r keeps ``[r, r, r]``: as a shared extra checkpointing refuses it; as a rank extra
    each rank gets its own back."""
    import attrs

    import faccel

    dist = faccel.detect()
    state, _ = fresh(dist, example_spec(), seed=0)
    mine = {"batch": torch.full((3,), dist.rank), "seen": dist.rank * 10}
    try:
        faccel.checkpoint(dist, attrs.evolve(state, extras={"seen": [dist.rank] * 3}), root)
        refused = ""
    except faccel.errors.CheckpointError as error:
        refused = str(error)
    listed = sorted(os.listdir(root)) if os.path.isdir(root) else []
    faccel.checkpoint(dist, attrs.evolve(state, rank_extras=mine, extras={"shared": [7, 7]}), root)
    target, _ = fresh(dist, example_spec(), seed=1)
    placeholders = {"batch": torch.zeros(3, dtype=torch.int64), "seen": None}
    target = attrs.evolve(target, rank_extras=placeholders, extras={"shared": None})
    restored = faccel.restore(dist, target, root)
    return {
        "refused": refused,
        "listed_after_refusal": listed,
        "batch": restored.rank_extras["batch"].tolist(),
        "seen": restored.rank_extras["seen"],
        "shared": restored.extras["shared"],
    }


def called_on_rank0_only(root: str, arrival: float) -> dict:
    """``if dist.is_main_process: checkpoint(...)`` then rank 1 trains on into a collective.

    Rank 0 reports its error and how long it took; rank 1 what its next
    collective saw once rank 0 gave up (and its process ended).
    """
    import datetime
    import time

    import torch.distributed as tdist

    import faccel

    dist = faccel.detect(timeout=datetime.timedelta(seconds=60))
    state, _ = fresh(dist, example_spec(), seed=0)
    begin = time.monotonic()
    try:
        if dist.is_main_process:
            faccel.checkpoint(dist, state, root, arrival_timeout=datetime.timedelta(seconds=arrival))
        else:
            tdist.all_reduce(torch.ones(1))  # DDP's next gradient all_reduce
        error = ""
    except Exception as caught:  # the point is what each rank sees
        error = f"{type(caught).__name__}: {caught}"
    return {"rank": dist.rank, "error": error, "seconds": time.monotonic() - begin}


def each_collective_alone(root: str, arrival: float) -> dict:
    """Rank 0 calls checkpoint, restore and save_model alone; then both ranks meet in a barrier
    (the group still works: the check-in went through the store); then rank 1 calls
    checkpoint, late: the arrival rank 0 gave up on."""
    import datetime
    import time

    import faccel

    dist = faccel.detect(timeout=datetime.timedelta(seconds=20))
    state, _ = fresh(dist, example_spec(), seed=0)
    wait = datetime.timedelta(seconds=arrival)
    calls = {
        "checkpoint": lambda: faccel.checkpoint(dist, state, root, arrival_timeout=wait),
        "restore": lambda: faccel.restore(dist, state, root, arrival_timeout=wait),
        "save_model": lambda: faccel.save_model(dist, state.model, root, arrival_timeout=wait),
    }
    seen: dict[str, Any] = {}
    if dist.rank == 0:
        for name, call in calls.items():
            begin = time.monotonic()
            try:
                call()
                seen[name] = ["", 0.0]
            except faccel.errors.CheckpointError as error:
                seen[name] = [str(error), time.monotonic() - begin]
    faccel.wait_for_everyone(dist)
    if dist.rank == 1:
        begin = time.monotonic()
        try:
            calls["checkpoint"]()
            seen["late"] = ["", 0.0]
        except faccel.errors.CheckpointError as error:
            seen["late"] = [str(error), time.monotonic() - begin]
    faccel.wait_for_everyone(dist)
    return {
        "rank": dist.rank,
        "seen": seen,
        "listed": sorted(os.listdir(root)) if os.path.isdir(root) else [],
    }


def slow_checkpoint(root: str, group_timeout: float, delay: float) -> dict:
    """Rank 0's writing takes longer than the process group's timeout."""
    import datetime
    import time

    import attrs

    import faccel
    from faccel._checkpoint import _jobs

    dist = faccel.detect(timeout=datetime.timedelta(seconds=group_timeout))
    state, _ = fresh(dist, example_spec(), seed=0)
    write = _jobs._write_rank0

    def slow(*args: Any) -> Any:
        time.sleep(delay)  # a slow network file system
        return write(*args)

    _jobs._write_rank0 = slow
    try:
        faccel.checkpoint(dist, attrs.evolve(state, step=3), root)
        error = ""
    except Exception as caught:  # the point is which error each rank sees
        error = f"{type(caught).__name__}: {caught}"
    listed = [name for name in os.listdir(root) if name.startswith("step-")]
    return {"rank": dist.rank, "error": error, "listed": listed}


def die_at_operation(
    kill_at: int, patches: list[tuple[Any, str]], work: Callable[[], object], count_file: str
) -> None:
    """Run ``work`` with each patched function counting its calls; SIGKILL this process at call ``kill_at``.

    ``kill_at=0`` never kills: it writes the number of calls to ``count_file`` (the dry run).
    """
    import signal

    count = 0

    def counted(original: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            nonlocal count
            count += 1
            if count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        return wrapper

    for module, name in patches:
        setattr(module, name, counted(getattr(module, name)))
    work()
    if kill_at == 0:
        with open(count_file, "w") as handle:
            handle.write(str(count))


def seconds_of_one_crash_trial(root: str) -> float:
    """The duration, measured here, of one unkilled checkpoint of the crash loop's state and its restore.

    The crash tests scale their deadline from it, never from a fixed number of seconds.
    """
    import time

    import faccel

    dist = faccel.detect({})
    state = crash_state(0)
    faccel.checkpoint(dist, state, os.path.join(root, ".calibrate"))  # one-time costs
    start = time.monotonic()
    faccel.checkpoint(dist, at_step(state, 1), os.path.join(root, ".calibrate"))
    crash_check(os.path.join(root, ".calibrate"))
    return time.monotonic() - start


def unstorable_rank_extras(root: str) -> dict:
    """Rank 1's ``rank_extras`` holds a value checkpoints cannot store; each rank catches the error,
    then both train on (one all_reduce) and checkpoint again without it."""
    import datetime

    import attrs
    import torch.distributed as tdist

    import faccel

    dist = faccel.detect(timeout=datetime.timedelta(seconds=10))
    state, _ = fresh(dist, example_spec(), seed=0)
    bad = attrs.evolve(state, rank_extras={"handle": object()} if dist.rank == 1 else {})
    try:
        faccel.checkpoint(dist, bad, root)
        error = ""
    except Exception as caught:  # what each rank sees is the point
        error = f"{type(caught).__name__}: {caught}"
    total = torch.ones(1)
    tdist.all_reduce(total)  # the user caught it and trains on
    after = faccel.checkpoint(dist, attrs.evolve(state, step=state.step + 1), root).name
    return {"error": error, "sum": float(total.item()), "after": after}
