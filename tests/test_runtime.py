"""The runtime handle: one per detect, outside equality, closed by shutdown, staging released on demand."""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import torch

import faccel
from faccel._dist._runtime import Crumb, Runtime


def test_each_state_has_its_own_handle_outside_equality() -> None:
    one, two = faccel.detect({}), faccel.detect({})
    assert one == two and hash(one) == hash(two)  # the same facts
    assert one.runtime is not two.runtime  # two detects never share resources
    assert attrs.evolve(one, seed=3).runtime is one.runtime  # a derived state keeps its run's handle
    assert "runtime" not in repr(one)
    simulated = faccel.DistState.simulated(rank=1, world_size=4)
    assert isinstance(simulated.runtime, Runtime)
    assert copy.deepcopy(one).runtime is not one.runtime  # a copy starts empty


def test_free_memory_and_shutdown_release_the_staging_buffers(tmp_path: Path) -> None:
    dist = faccel.detect({})
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = faccel.TrainState.create(model=model, optimizer=optimizer)
    faccel.checkpoint(dist, state, tmp_path, blocking=False)
    assert dist.runtime.staging  # kept for the next non-blocking checkpoint
    faccel.free_memory(dist)  # waits for the write, then releases
    assert dist.runtime.pending is None and not dist.runtime.staging
    assert faccel.latest_checkpoint(tmp_path) is not None
    faccel.checkpoint(dist, attrs.evolve(state, step=1), tmp_path, blocking=False)
    assert dist.runtime.staging
    faccel.shutdown(dist)
    assert dist.runtime.pending is None and not dist.runtime.staging and not dist.runtime.hooks


def test_the_breadcrumb_is_bounded_and_round_trips() -> None:
    runtime = Runtime()
    for k in range(50):
        runtime.note(f"call{k}", collective=True)
    assert len(runtime.crumbs) == 8 and runtime.last() == Crumb(call="call49", number=50, step=None)
    crumb = Crumb(call="reduce", number=3, step=7, backwards=12)
    assert Crumb.parse(crumb.text()) == crumb
    assert Crumb.parse("garbage") is None


def _fields(loader: faccel.PreparedLoader) -> list[object]:
    return [getattr(loader, a.name) for a in attrs.fields(faccel.PreparedLoader)]


def test_a_prepared_loader_is_a_value_through_two_epochs_and_a_restore(tmp_path: Path) -> None:
    dist = faccel.DistState.simulated(rank=0, world_size=1)
    data = torch.utils.data.TensorDataset(torch.arange(12.0))
    loader = faccel.prepare(dist, torch.utils.data.DataLoader(data, batch_size=3, shuffle=True))
    before = _fields(loader)
    assert not any(isinstance(value, list | dict | set) for value in before)  # no cells
    for epoch in range(2):
        assert len(list(loader.at(epoch=epoch))) == 4
    list(loader)  # the bare view, once
    assert _fields(loader) == before and all(a is b for a, b in zip(_fields(loader), before, strict=True))
    model = torch.nn.Linear(1, 1)
    state = faccel.TrainState.create(model=model, optimizer=None, loader=loader, epoch=1, position=2)
    faccel.checkpoint(dist, state, tmp_path)
    restored = faccel.restore(dist, state, tmp_path)
    assert restored.loader is loader and _fields(loader) == before
    # The guards still hold, from the runtime's record: a second bare pass raises.
    import pytest

    with pytest.raises(faccel.errors.UsageError, match="iterated a second time"):
        list(loader)


def test_the_train_timeout_is_read_beside_faccel_timeout() -> None:
    import datetime

    import pytest

    from faccel._dist._state import state_from_env

    assert state_from_env({}).train_timeout is None
    assert state_from_env({"FACCEL_TRAIN_TIMEOUT": "60"}).train_timeout == datetime.timedelta(seconds=60)
    given = datetime.timedelta(seconds=5)
    assert state_from_env({"FACCEL_TRAIN_TIMEOUT": "60"}, train_timeout=given).train_timeout == given
    with pytest.raises(faccel.errors.LaunchError, match="FACCEL_TRAIN_TIMEOUT must be a positive"):
        state_from_env({"FACCEL_TRAIN_TIMEOUT": "soon"})


def test_another_handles_background_checkpoint_is_found_through_its_handle_not_a_thread_name() -> None:
    # wait() found other handles' checkpoints among threads named "faccel-checkpoint".
    import threading

    first, second = Runtime(), Runtime()
    release = threading.Event()
    pending = first.background(3, release.wait)
    decoy = threading.Thread(target=release.wait, name="faccel-checkpoint")  # a name alone is nobody's
    pending.thread.start()
    decoy.start()
    try:
        assert second.others_writing() == [pending.thread]
        assert first.others_writing() == []
    finally:
        release.set()
        pending.thread.join()
        decoy.join()


def test_shutdown_removes_the_hooks_and_groups_the_handle_holds() -> None:
    dist = faccel.detect({})
    model = torch.nn.Linear(2, 1)
    calls: list[int] = []
    dist.runtime.hold(model.register_forward_pre_hook(lambda module, args: calls.append(1)))
    dist.runtime.group("a group", lambda: "made once")
    assert dist.runtime.group("a group", lambda: "made twice") == "made once"
    model(torch.ones(1, 2))
    faccel.shutdown(dist)
    model(torch.ones(1, 2))
    assert calls == [1] and not model._forward_pre_hooks
    assert dist.runtime.handles == {} and dist.runtime.groups == {}
