"""checkpoint(..., blocking=False): the state as it was at the call, written and committed on a thread;
the next call waits, and a failure there is raised by the next call, with nothing committed."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch

pytestmark = pytest.mark.usefixtures("keep_global_generators")  # restore sets the global generators


def _state(seed: int) -> object:
    import faccel

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    return faccel.TrainState.create(model=model, optimizer=optimizer, extras={"ema": torch.ones(3)})


@pytest.mark.parametrize("sharded", [False, True])
def test_the_state_at_the_call_is_committed_while_training_goes_on(tmp_path: Path, sharded: bool) -> None:
    import faccel

    dist = faccel.detect({})
    state = _state(0)
    saved = [p.detach().clone() for p in state.model.parameters()]
    folder = faccel.checkpoint(dist, attrs.evolve(state, step=5), tmp_path, sharded=sharded, blocking=False)
    with torch.no_grad():  # training goes on at once, in place
        for p in state.model.parameters():
            p.fill_(123.0)
        state.extras["ema"].fill_(7.0)
    target = _state(1)
    restored = faccel.restore(dist, target, tmp_path)  # waits for the background commit first
    assert folder.is_dir() and restored.step == 5
    assert all(torch.equal(a, b) for a, b in zip(saved, target.model.parameters(), strict=True))
    assert torch.equal(restored.extras["ema"], torch.ones(3))


def test_a_background_failure_is_raised_by_the_next_call_and_commits_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import faccel
    from faccel._checkpoint import _jobs

    dist = faccel.detect({})
    state = _state(0)

    def full_disk(*args: object, **kwargs: object) -> object:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(_jobs, "write_shard", full_disk)
    faccel.checkpoint(dist, attrs.evolve(state, step=1), tmp_path, sharded=True, blocking=False)
    with pytest.raises(faccel.errors.CheckpointError, match=r"background checkpoint of step 1 .* failed"):
        faccel.checkpoint(dist, attrs.evolve(state, step=2), tmp_path, sharded=True)  # raises before writing
    monkeypatch.undo()
    assert faccel.latest_checkpoint(tmp_path) is None  # nothing of step 1 is visible
    # The error was raised once: the run goes on, and shutdown has nothing left to wait for.
    assert faccel.checkpoint(dist, attrs.evolve(state, step=2), tmp_path, sharded=True).name.endswith("2")
    faccel.shutdown(dist)


def test_shutdown_waits_for_the_background_checkpoint(tmp_path: Path) -> None:
    import faccel

    dist = faccel.detect({})
    folder = faccel.checkpoint(dist, attrs.evolve(_state(0), step=3), tmp_path, blocking=False)
    faccel.shutdown(dist)
    assert faccel.latest_checkpoint(tmp_path) == folder
