from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DistributedSampler

from tests.strategies import interrupted_epochs, shardings


def _all_ranks(kwargs: dict, epoch: int = 0):
    from faccel import Sharding

    return [Sharding(rank=r, **kwargs) for r in range(kwargs["world_size"])]


@settings(max_examples=120)
@given(shardings())
def test_shards_cover_the_dataset_once_plus_reported_padding(kwargs: dict) -> None:
    ranks = _all_ranks(kwargs)
    n, w, b = kwargs["num_samples"], kwargs["world_size"], kwargs["batch_size"]
    # Only positions are needed for coverage: positions of all ranks partition [0, total).
    total = ranks[0].total
    seen = torch.cat([s.positions() for s in ranks]).sort().values
    assert torch.equal(seen, torch.arange(total))
    if kwargs["drop_last"]:
        assert total == (n // (w * b)) * w * b and ranks[0].padding == 0
    else:
        assert total == n + ranks[0].padding
    if not kwargs["even_batches"] or kwargs["drop_last"]:
        assert ranks[0].padding == 0
    counts = {s.num_batches for s in ranks}
    if kwargs["even_batches"] or kwargs["drop_last"]:
        assert len(counts) == 1
    else:
        assert max(counts) - min(counts) <= 1


@settings(max_examples=120)
@given(shardings(max_samples=3000, max_world=64), st.integers(0, 3))
def test_indices_are_the_dataset_each_once_plus_padding(kwargs: dict, epoch: int) -> None:
    ranks = _all_ranks(kwargs)
    counter = Counter(i for s in ranks for batch in s.batches(epoch) for i in batch)
    n, padding = kwargs["num_samples"], ranks[0].padding
    if kwargs["drop_last"]:
        assert sum(counter.values()) == ranks[0].total and max(counter.values(), default=1) == 1
    else:
        assert set(counter) == set(range(n))
        assert sum(counter.values()) == n + padding
    for s in ranks:
        sizes = [len(batch) for batch in s.batches(epoch)]
        assert all(size == s.batch_size for size in sizes[:-1])
        assert len(sizes) == s.num_batches


@settings(max_examples=200)
@given(shardings(max_samples=5000, max_world=128))
def test_padding_is_the_fewest_that_evens_the_batches(kwargs: dict) -> None:
    from faccel import Sharding

    kwargs = {**kwargs, "drop_last": False, "even_batches": True}
    s = Sharding(rank=0, **kwargs)
    if s.padding == 0:
        return
    # One sample fewer and the last rank would have one batch fewer than rank 0.
    fewer = Sharding(rank=kwargs["world_size"] - 1, **{**kwargs, "even_batches": False})
    shorter_total = s.total - 1
    last_rank_count = -(-(shorter_total - (kwargs["world_size"] - 1)) // kwargs["world_size"])
    assert -(-last_rank_count // kwargs["batch_size"]) < s.num_batches
    assert fewer.num_batches <= s.num_batches


@given(shardings(max_samples=2000, max_world=32), st.integers(0, 50), st.integers(0, 50))
def test_order_is_a_function_of_seed_and_epoch(kwargs: dict, e1: int, e2: int) -> None:
    from faccel import Sharding

    s = Sharding(rank=0, **kwargs)
    assert s.batches(e1) == Sharding(rank=0, **kwargs).batches(e1)
    if kwargs["shuffle"] and kwargs["num_samples"] > 20 and e1 != e2:
        assert s.order(e1).tolist() != s.order(e2).tolist()
    if not kwargs["shuffle"]:
        assert s.batches(e1) == s.batches(e2)


@given(shardings(max_samples=2000, max_world=32), st.integers(0, 5), st.data())
def test_start_skips_exactly_the_consumed_batches(kwargs: dict, epoch: int, data) -> None:
    from faccel import Sharding

    s = Sharding(rank=data.draw(st.integers(0, kwargs["world_size"] - 1)), **kwargs)
    start = data.draw(st.integers(0, s.num_batches + 1))
    assert s.batches(epoch, start=start) == s.batches(epoch)[start:]


@given(
    st.integers(0, 3000),
    st.integers(1, 64),
    st.integers(1, 32),
    st.booleans(),
    st.integers(0, 2**31),
    st.integers(0, 5),
)
def test_matches_distributed_sampler_where_they_should(
    n: int, batch: int, world: int, shuffle: bool, seed: int, epoch: int
) -> None:
    """drop_last: equal to DistributedSampler(drop_last) + BatchSampler(drop_last) for any batch
    size; without drop_last and batch size 1: equal to DistributedSampler's padding."""
    from faccel import Sharding

    for rank in range(world):
        ds = DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=True
        )
        ds.set_epoch(epoch)
        expected = list(BatchSampler(ds, batch, drop_last=True))
        ours = Sharding(
            num_samples=n,
            batch_size=batch,
            rank=rank,
            world_size=world,
            shuffle=shuffle,
            drop_last=True,
            seed=seed,
        )
        assert ours.batches(epoch) == expected
        if n == 0:
            continue
        ds = DistributedSampler(
            range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed, drop_last=False
        )
        ds.set_epoch(epoch)
        ours = Sharding(num_samples=n, batch_size=1, rank=rank, world_size=world, shuffle=shuffle, seed=seed)
        assert [i for b in ours.batches(epoch) for i in b] == list(ds)


def test_bad_arguments_are_named() -> None:
    from faccel import Sharding
    from faccel.errors import ArgumentValueError

    with pytest.raises(ArgumentValueError, match="batch_size"):
        Sharding(num_samples=4, batch_size=0)
    with pytest.raises(ArgumentValueError, match="rank"):
        Sharding(num_samples=4, batch_size=1, rank=2, world_size=2)
    with pytest.raises(ArgumentValueError, match="start"):
        Sharding(num_samples=4, batch_size=1).batches(0, start=-1)
    with pytest.raises(ArgumentValueError, match=r"num_samples must be >= 0, got -1"):
        Sharding(num_samples=-1, batch_size=1)


@settings(max_examples=150, deadline=None)
@given(interrupted_epochs())
def test_an_epoch_resumed_at_other_world_sizes_sees_each_sample_once(spec: dict) -> None:
    """The pure law behind resuming at another world size, for worlds of 1 to 256 ranks.

    Stage by stage, every rank reads some of its batches; the next stage's ranks deal the rest
    of the epoch's order afresh from ``consumed_after``. Over all stages each sample is read
    exactly once, plus padding that ``is_padding`` reports, no more than the last stage's
    world needs to even its batches.
    """
    from faccel import Sharding

    flags = {key: spec[key] for key in ("num_samples", "shuffle", "drop_last", "even_batches", "seed")}
    n = spec["num_samples"]
    consumed, real, padding = 0, Counter[int](), 0
    for number, (world, batch, fraction) in enumerate(spec["stages"]):
        ranks = [
            Sharding(rank=r, world_size=world, batch_size=batch, consumed=consumed, **flags)
            for r in range(world)
        ]
        last = number == len(spec["stages"]) - 1
        batches = ranks[0].num_batches
        # Interrupted mid-epoch (a checkpoint after the last batch is an epoch boundary).
        read = batches if last else max(0, min(int(fraction * batches), batches - 1))
        counts = {s.num_batches for s in ranks}
        if spec["even_batches"] or spec["drop_last"]:
            assert len(counts) == 1  # the padding rule, applied afresh to the remainder
        for s in ranks:
            positions = s.positions()[: read * batch].tolist()
            assert all(p >= consumed for p in positions)
            real.update(p for p in positions if not s.is_padding(p))
            padding += sum(1 for p in positions if s.is_padding(p))
            if not last:
                assert not any(s.is_padding(p) for p in positions)  # padding only at the epoch's end
        if last:
            assert padding == ranks[0].padding
            if padding:  # the fewest: one sample less would leave a rank a batch short
                assert padding < world and not spec["drop_last"] and spec["even_batches"]
        consumed = ranks[0].consumed_after(read)
        if last and read:
            assert consumed == n  # the epoch is over, its dropped tail included
    assert max(real.values(), default=1) == 1  # never a sample twice
    if not spec["drop_last"]:
        assert sorted(real) == list(range(n))  # every sample of the epoch
