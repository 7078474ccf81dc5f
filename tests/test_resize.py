"""Resuming at another world size, in one process: the loader's forms, the checkpoint's record, the errors.

The multi-process proof is tests/distributed/test_resize.py; the pure law, tests/test_sharding.py.
A restore "at another world size" here uses a simulated DistState of the rank being restored.
"""

from __future__ import annotations

import random
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


def _state(dist, *, loader: bool = True, samples: int = 20, **extra):
    import faccel

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(samples)), batch_size=3, shuffle=True))
    state = faccel.TrainState.create(
        model=model, optimizer=optimizer, loader=data if loader else None, **extra
    )
    return state, data


def test_a_checkpoint_records_the_global_position_and_another_world_size_continues_from_it(
    tmp_path: Path,
) -> None:
    import faccel
    from faccel._checkpoint._load import new_rank_seed

    one = faccel.detect({})
    state, _ = _state(one)
    faccel.checkpoint(one, attrs.evolve(state, step=6, epoch=1, position=6), tmp_path)  # 18 of 20 read
    assert '"consumed":18' in (faccel.latest_checkpoint(tmp_path) / "state.json").read_text()

    same, loader = _state(one)
    restored = faccel.restore(one, same, tmp_path)  # the same world size: as saved
    assert (restored.position, restored.resumed_at, restored.consumed) == (6, None, 0)
    assert [b.tolist() for (b,) in loader.resume(restored)] == [
        b.tolist() for (b,) in loader.at(epoch=1, start=6)
    ]

    seen = []
    for rank in range(3):
        dist = faccel.DistState.simulated(rank=rank, world_size=3)
        target, loader = _state(dist)
        restored = faccel.restore(dist, target, tmp_path)
        assert (restored.epoch, restored.position, restored.resumed_at) == (1, 0, (1, 18))
        if rank > 0:  # no generators saved for it: seeded from (seed, step, rank)
            expected = new_rank_seed(dist.seed, 6, rank)
            assert random.random() == random.Random(expected).random()
            assert np.random.rand() == np.random.RandomState(expected).rand()
            assert (
                torch.rand(1).item()
                == torch.rand(1, generator=torch.Generator().manual_seed(expected)).item()
            )
        with pytest.raises(faccel.errors.UsageError, match=r"loader.resume\(state\)"):
            list(loader.at(epoch=1, start=restored.position))  # would read epoch 1 from its start
        list(loader.at(epoch=0))  # other epochs are unaffected
        view = loader.resume(restored)
        seen += [i for (batch,) in view for i in batch.tolist()]
        assert (view.consumed, view.padding) == (18, 1)  # 2 left for 3 ranks: one repeat
        list(loader.at(epoch=1, start=restored.position))  # once resumed, the guard is gone
    order = faccel.Sharding(num_samples=20, batch_size=3, shuffle=True).order(1).tolist()
    assert sorted(seen) == sorted([*order[18:], order[0]])  # the last 2 and one padding repeat


def test_what_cannot_be_carried_over_is_refused(tmp_path: Path) -> None:
    import faccel

    one = faccel.detect({})
    two = faccel.DistState.simulated(rank=0, world_size=2)
    state, _ = _state(one, loader=False)
    faccel.checkpoint(one, attrs.evolve(state, step=1, position=2), tmp_path / "bare")
    target, _ = _state(two)
    with pytest.raises(faccel.errors.CheckpointError, match=r"saved without TrainState.loader"):
        faccel.restore(two, target, tmp_path / "bare")

    state, _ = _state(one)
    faccel.checkpoint(one, attrs.evolve(state, step=1, position=2), tmp_path / "full")
    target, _ = _state(two, loader=False)
    with pytest.raises(faccel.errors.CheckpointError, match=r"pass the training loader"):
        faccel.restore(two, target, tmp_path / "full")
    target, _ = _state(two, samples=5)
    with pytest.raises(
        faccel.errors.CheckpointError, match=r"6 samples of the epoch were read, but the loader"
    ):
        faccel.restore(two, target, tmp_path / "full")
    state, _ = _state(one, rank_extras={"seen": 0})
    faccel.checkpoint(one, state, tmp_path / "extras")  # at an epoch boundary, even
    target, _ = _state(two, rank_extras={"seen": 0})
    with pytest.raises(faccel.errors.CheckpointError, match=r"rank_extras \['seen'\] belong to the ranks"):
        faccel.restore(two, target, tmp_path / "extras")


def test_the_loader_forms_refuse_what_they_cannot_do_exactly() -> None:
    import faccel
    from faccel._train_state import global_position

    dist = faccel.detect({})
    state, loader = _state(dist)
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"consumed must be in \[0, num_samples=20\]"):
        loader.at(epoch=0, consumed=21)
    with pytest.raises(faccel.errors.ArgumentError, match="resumed_at must be None or a tuple"):
        attrs.evolve(state, resumed_at=[1, 2])
    with pytest.raises(faccel.errors.ArgumentError, match=r"the loader faccel\.prepare returned"):
        attrs.evolve(state, loader=DataLoader(TensorDataset(torch.arange(3))))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(torch.arange(7))

    stream = faccel.prepare(dist, DataLoader(Stream(), batch_size=2))
    with pytest.raises(faccel.errors.ArgumentValueError, match="IterableDataset"):
        stream.at(epoch=0, consumed=2)
    assert global_position(attrs.evolve(state, loader=stream, position=1)) is None
    assert global_position(attrs.evolve(state, loader=None, position=1)) is None
    # consumed=0 is the plain view, seeds and all
    assert [b.tolist() for (b,) in loader.at(epoch=2, consumed=0)] == [
        b.tolist() for (b,) in loader.at(epoch=2)
    ]
