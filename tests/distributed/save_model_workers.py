"""save_model killed with SIGKILL: the functions tests/test_save_model_crash.py runs in a helper process.

Every weight of version ``v`` is ``v``, so a load that mixed the files of two
saves shows it. The versions cycle through the layouts (four shards, four
again, one file, two shards), so a kill lands in every switch between them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.distributed.checkpoint_workers import _fork, _wait, die_at_operation, kill_loop

LAYERS, WIDTH = 4, 256
# max_shard_size of version v: SHARD_SIZES[v % 4]; a layer (weight and bias) is 263,168 bytes.
SHARD_SIZES = (270_000, 270_000, 10**9, 600_000)
SHARD_COUNTS = (4, 4, 1, 2)
MIXED, UNLOADABLE = -1, -2


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def _save(dist: Any, model: nn.Module, directory: str, version: int) -> None:
    import faccel

    with torch.no_grad():
        for tensor in model.parameters():
            tensor.fill_(version)
    faccel.save_model(dist, model, directory, max_shard_size=SHARD_SIZES[version % len(SHARD_SIZES)])


def read_version(directory: str) -> int:
    """The version ``load_model`` loads from ``directory``: ``MIXED`` if its weights come from
    two saves, ``UNLOADABLE`` if it raises."""
    import faccel

    target = _model()
    with torch.no_grad():
        for tensor in target.parameters():
            tensor.fill_(-3)
    try:
        faccel.load_model(faccel.detect({}), target, directory)
    except faccel.errors.CheckpointError:
        return UNLOADABLE
    values = set(torch.cat([t.flatten() for t in target.state_dict().values()]).unique().tolist())
    return int(values.pop()) if len(values) == 1 else MIXED


def expected_files(version: int) -> list[str]:
    """The layout a complete save of ``version`` leaves, shard names without their tag."""
    count = SHARD_COUNTS[version % len(SHARD_COUNTS)]
    if count == 1:
        return ["model.safetensors"]
    shards = [f"model-TAG-{k:05d}-of-{count:05d}.safetensors" for k in range(1, count + 1)]
    return sorted([*shards, "model.safetensors.index.json"])


def untagged(directory: str) -> list[str]:
    """The files in ``directory``, the 8-hex-digit tag of a shard's name replaced by ``TAG``."""
    import re

    return sorted(re.sub(r"^model-[0-9a-f]{8}-", "model-TAG-", name) for name in os.listdir(directory))


def save_model_crash_trials(directory: str, trials: int, delay_in_writes: float, seed: int) -> dict:
    """Save version after version over an earlier complete save; SIGKILL each writer at a random
    moment (:func:`kill_loop`); after each kill, load. Then one more save (a restarted job's)."""
    import faccel

    dist = faccel.detect({})
    model = _model()
    _save(dist, model, directory + ".warmup", 1)  # one-time costs, before any kill
    _save(dist, model, directory, 0)  # the earlier complete save
    most_files = 0

    def check() -> int:
        nonlocal most_files
        most_files = max(most_files, len(os.listdir(directory)))
        return read_version(directory)

    outcomes = kill_loop(
        lambda version: _save(dist, model, directory, version),
        check,
        trials=trials,
        delay_in_writes=delay_in_writes,
        seed=seed,
    )
    final = max(max(pair) for pair in outcomes) + 1
    _save(dist, model, directory, final)
    return {
        "outcomes": outcomes,
        "most_files": most_files,
        "final": [read_version(directory), final],
        "files": [untagged(directory), expected_files(final)],
    }


def seconds_of_one_crash_trial(directory: str) -> float:
    """The duration, measured here, of one unkilled save of the crash loop's model and its load check.

    The crash test scales its deadline from it, never from a fixed number of seconds.
    """
    import time

    import faccel

    dist = faccel.detect({})
    model = _model()
    _save(dist, model, directory, 0)  # one-time costs
    start = time.monotonic()
    _save(dist, model, directory, 1)
    read_version(directory)
    return time.monotonic() - start


def save_model_kill_at_every_operation(directory: str, before: int, after: int) -> dict:
    """Save version ``after`` over a complete save of ``before``, SIGKILLed at its 1st, 2nd, ... file
    operation (``os.open``, ``os.write``, ``os.fsync``, ``os.replace``, ``os.rename``,
    ``os.unlink``); after each kill, load, then save ``after`` again (a restarted job).

    Returns the number of operations, the version loaded after each kill, and the
    retries' versions and files.
    """
    import faccel

    dist = faccel.detect({})
    model = _model()
    return _kill_at_every_operation(dist, model, directory, before, after)


# --- save_model of a sharded model, every rank writing its share: test_save_model_sharded.py


def tiny_gpt2(seed: int = 0) -> nn.Module:
    """A small GPT-2 (tied embedding and head) from its config, no hub access."""
    import transformers

    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=101, n_positions=64, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config).eval()


TOKENS = {"low": 0, "high": 101, "size": (2, 16)}


def tokens() -> torch.Tensor:
    return torch.randint(**TOKENS, generator=torch.Generator().manual_seed(1))  # type: ignore[call-overload]


def _spy_files(opened: list[str]) -> None:
    """Record the name of every weight file this rank writes (the local store's publisher, wrapped)."""
    from faccel._storage._local import LocalStore

    original = LocalStore.publisher

    def recorded(self: LocalStore, key: str) -> Any:
        opened.append(os.path.basename(key))
        return original(self, key)

    LocalStore.publisher = recorded  # type: ignore[method-assign]


def _fail_writes_on(rank: int) -> None:
    """This rank's weight files fail to open, as on a full disk."""
    import errno

    from faccel._storage._local import LocalStore

    def full(self: LocalStore, key: str) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device (injected)", key)

    LocalStore.publisher = full  # type: ignore[method-assign]


def sharded_gpt2_save(directory: str, small_shards: int, failing: str) -> dict[str, Any]:
    """FSDP2 on every rank: save_model of a tiny GPT-2 (default max_shard_size), then again over it in
    shards of ``small_shards`` bytes; then a save into ``failing`` whose writes fail on rank 1.

    Returns each rank's files, the prepared model's logits, and what load_model of the
    saves into a fresh sharded model gives back.
    """
    import faccel

    dist = faccel.detect(strategy="fsdp")
    model = faccel.prepare(dist, tiny_gpt2())
    with torch.no_grad():
        logits = model(tokens()).logits
    opened: list[str] = []
    _spy_files(opened)
    faccel.save_model(dist, model, os.path.join(directory, "default"))
    default_files = list(opened)
    opened.clear()
    faccel.save_model(dist, model, os.path.join(directory, "default"), max_shard_size=small_shards)
    small_files = list(opened)
    faccel.save_model(dist, model, failing)  # the earlier save the failed one must leave

    # load_model of the sharded save into a sharded model prepared from other weights: bitwise back
    fresh = faccel.prepare(dist, tiny_gpt2(seed=1))
    faccel.load_model(dist, fresh, os.path.join(directory, "default"))
    back = all(
        torch.equal(a.full_tensor(), b.full_tensor())
        for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
    )
    with torch.no_grad():
        fresh_logits = fresh(tokens()).logits

    # a model of one tensor: a plan of one file, model.safetensors, committed by its own rename
    torch.manual_seed(2)
    single = faccel.prepare(dist, nn.Linear(8, 6, bias=False))
    faccel.save_model(dist, single, os.path.join(directory, "single"))
    single_weight = single.weight.full_tensor().flatten().tolist()

    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)  # a later version, whose save fails on rank 1
    _fail_writes_on(1) if dist.rank == 1 else None
    try:
        faccel.save_model(dist, model, failing)
        failure = "none"
    except faccel.errors.StorageError as error:
        failure = str(error)
    return {
        "rank": dist.rank,
        "default_files": default_files,
        "small_files": small_files,
        "logits": logits.flatten().tolist(),
        "fresh_logits_equal": torch.equal(fresh_logits, logits),
        "loaded_back": back,
        "failure": failure,
        "single_weight": single_weight,
    }


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a Hugging Face folder (one file, or an index and its shards), read by the
    safetensors library; the index checked against the shards."""
    from safetensors.torch import load_file

    if (directory / "model.safetensors").exists():
        return load_file(directory / "model.safetensors")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for file in sorted(set(index["weight_map"].values())):
        part = load_file(directory / file)
        assert all(index["weight_map"][name] == file for name in part)
        out.update(part)
    assert set(out) == set(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in out.values())
    return out


def sharded_save_kill_at_every_operation(directory: str, before: int, after: int) -> dict:
    """As :func:`save_model_kill_at_every_operation`, through a sharded model's save (an FSDP2 model
    on a world of one, forked at every kill point): the writer thread, the plan's shards, rank 0's commit.

    ``prepare`` leaves a one-process model unsharded, so the model is sharded here by torch's own
    ``fully_shard`` over a gloo group of one (which a forked child may use: it has no peers).
    """
    import torch.distributed as tdist
    from torch.distributed.fsdp import fully_shard

    import faccel
    from faccel._loop._model import is_sharded

    tdist.init_process_group("gloo", rank=0, world_size=1)
    dist = faccel.detect({})
    model = _model()
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    assert is_sharded(model)  # save_model takes the sharded model's path
    return _kill_at_every_operation(dist, model, directory, before, after)


def _kill_at_every_operation(dist: Any, model: Any, directory: str, before: int, after: int) -> dict:
    """The kill loop of the two tests above: count the save's file operations, then die at each."""
    _save(dist, model, directory + ".warmup", 1)

    def reset() -> None:
        shutil.rmtree(directory, ignore_errors=True)
        _save(dist, model, directory, before)

    def write_and_die_at(kill_at: int) -> None:
        patches = [(os, name) for name in ("open", "write", "fsync", "replace", "rename", "unlink")]
        die_at_operation(kill_at, patches, lambda: _save(dist, model, directory, after), directory + ".count")

    reset()
    assert _wait(_fork(lambda: write_and_die_at(0))) == 0
    with open(directory + ".count") as handle:
        total = int(handle.read())
    loaded, retried, files = [], [], []
    for kill_at in range(1, total + 1):
        reset()
        assert _wait(_fork(lambda k=kill_at: write_and_die_at(k))) == -signal.SIGKILL
        loaded.append(read_version(directory))
        _save(dist, model, directory, after)
        retried.append(read_version(directory))
        files.append(untagged(directory))
    return {"operations": total, "loaded": loaded, "retried": retried, "files": files}
