from __future__ import annotations

from collections import namedtuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

Pair = namedtuple("Pair", ["x", "y"])


class _Indexed(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"index": i, "pair": Pair(torch.tensor([float(i)]), [torch.tensor(i)])}


class _Stream(IterableDataset):
    def __init__(self, n: int, sized: bool = True) -> None:
        self.n, self.sized = n, sized

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no length")
        return self.n


def _indices(loader) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def test_nested_batches_keep_their_structure() -> None:
    import faccel

    loader = faccel.prepare(faccel.detect({}), DataLoader(_Indexed(5), batch_size=2))
    batches = list(loader)
    assert len(batches) == len(loader) == 3
    first = batches[0]
    assert first["index"].tolist() == [0, 1]
    assert isinstance(first["pair"], Pair) and first["pair"].x.shape == (2, 1)


def test_to_device_moves_every_leaf() -> None:
    import faccel

    tree = {"a": (torch.ones(1, dtype=torch.float64), [torch.zeros(2)]), "b": Pair(1, "s")}
    moved = faccel.to_device(tree, torch.device("meta"))
    assert moved["a"][0].device.type == "meta" and moved["a"][1][0].device.type == "meta"
    assert moved["b"] == Pair(1, "s") and isinstance(moved["a"], tuple)
    assert tree["a"][0].device.type == "cpu"  # the input is not mutated


@given(
    st.integers(0, 200),
    st.integers(1, 16),
    st.integers(1, 6),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.integers(0, 3),
)
@settings(max_examples=40)
def test_prepared_loader_yields_the_sharding(n, batch, world, shuffle, drop_last, even, epoch) -> None:
    import faccel

    data = TensorDataset(torch.arange(n))
    shuffle = shuffle and n > 0  # torch's RandomSampler refuses an empty dataset itself
    for rank in range(world):
        dist = faccel.DistState.simulated(rank=rank, world_size=world, seed=3)
        loader = faccel.prepare(
            dist,
            DataLoader(data, batch_size=batch, shuffle=shuffle, drop_last=drop_last),
            even_batches=even,
        )
        expected = loader.sharding.batches(epoch)
        assert [b[0].tolist() for b in loader.at(epoch=epoch)] == expected
        assert len(loader) == len(expected) and loader.batch_size == batch


@given(st.integers(0, 120), st.integers(1, 8), st.integers(1, 5), st.booleans(), st.booleans())
@settings(max_examples=40)
def test_iterable_dataset_is_dealt_like_a_sequential_map(n, batch, world, drop_last, even) -> None:
    import faccel

    for rank in range(world):
        dist = faccel.DistState.simulated(rank=rank, world_size=world)
        stream = faccel.prepare(
            dist, DataLoader(_Stream(n), batch_size=batch, drop_last=drop_last), even_batches=even
        )
        mapped = faccel.prepare(
            dist,
            DataLoader(TensorDataset(torch.arange(n)), batch_size=batch, drop_last=drop_last),
            even_batches=even,
        )
        assert _indices(stream) == [b[0].tolist() for b in mapped]
        assert len(stream) == len(mapped)


def test_iterable_without_length_has_no_len_but_iterates() -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=1, world_size=2)
    loader = faccel.prepare(dist, DataLoader(_Stream(7, sized=False), batch_size=2))
    assert _indices(loader) == [[1, 3], [5]]
    with pytest.raises(faccel.errors.ArgumentError, match="length is unknown"):
        len(loader)


def test_loader_workers_keep_the_order() -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=0, world_size=2)
    plain = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(40)), batch_size=3, shuffle=True))
    workers = faccel.prepare(
        dist,
        DataLoader(
            TensorDataset(torch.arange(40)),
            batch_size=3,
            shuffle=True,
            num_workers=2,
            multiprocessing_context="fork",
        ),
    )
    assert [b[0].tolist() for b in workers.at(epoch=2)] == [b[0].tolist() for b in plain.at(epoch=2)]
    stream = faccel.prepare(
        dist, DataLoader(_Stream(23), batch_size=3, num_workers=2, multiprocessing_context="fork")
    )
    assert _indices(stream) == Sharding_batches(23, 3, 0, 2)


def Sharding_batches(n: int, b: int, rank: int, world: int) -> list[list[int]]:
    import faccel

    return faccel.Sharding(num_samples=n, batch_size=b, rank=rank, world_size=world).batches(0)


def test_views_are_frozen_and_independent() -> None:
    import faccel

    loader = faccel.prepare(
        faccel.detect({}), DataLoader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=True)
    )
    view = loader.at(epoch=0)
    first = [b[0].tolist() for b in view]
    assert [b[0].tolist() for b in view] == first  # iterating again: the same epoch
    assert [b[0].tolist() for b in loader] == first  # the bare loader is epoch 0's view
    later = loader.at(epoch=1, start=1)
    it_later, it_first = iter(later), iter(view)
    assert [b[0].tolist() for b in it_first] == first
    assert [b[0].tolist() for b in it_later] == [b[0].tolist() for b in loader.at(epoch=1)][1:]
    assert (loader.epoch, loader.start) == (0, 0)
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"epoch and start must be >= 0, got epoch=-1"):
        loader.at(epoch=-1)


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_bare_epoch_loop_over_a_shuffled_loader_stops_instead_of_repeating_epoch_0(shuffle: bool) -> None:
    import faccel

    data = TensorDataset(torch.arange(12))
    loader = faccel.prepare(faccel.detect({}), DataLoader(data, batch_size=4, shuffle=shuffle))
    seen = []
    if shuffle:
        with pytest.raises(faccel.errors.UsageError, match=r"loader\.at\(epoch=epoch\)"):
            for _epoch in range(2):  # what an Accelerate user writes
                seen.extend(b[0].tolist() for b in loader)
        assert len(seen) == 3  # epoch 0 ran; the repeat of its order did not
    else:  # no order to repeat: every epoch of a sequential loader is the same, as in PyTorch
        for _epoch in range(2):
            seen.extend(b[0].tolist() for b in loader)
        assert seen == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]] * 2
    # The loop written with at() sees every epoch's own order.
    orders = [[x for (b,) in loader.at(epoch=e) for x in b.tolist()] for e in range(3)]
    assert all(sorted(order) == list(range(12)) for order in orders)
    assert (len({tuple(o) for o in orders}) == 3) == shuffle


def test_iteration_does_not_consume_the_global_rng() -> None:
    import faccel

    loader = faccel.prepare(
        faccel.detect({}), DataLoader(TensorDataset(torch.arange(12)), batch_size=4, shuffle=True)
    )
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    for _ in loader.at(epoch=4):
        pass
    assert torch.equal(torch.rand(3), expected)


def test_loaders_faccel_cannot_shard_are_refused_clearly() -> None:
    import faccel
    from faccel.errors import PrepareError

    dist = faccel.detect({})
    data = TensorDataset(torch.arange(10))
    batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 2, False)
    assert len(faccel.prepare(dist, DataLoader(data, batch_sampler=batches))) == 5
    persistent = DataLoader(_Stream(4), batch_size=2, num_workers=1, persistent_workers=True)
    with pytest.raises(PrepareError, match="persistent_workers"):
        faccel.prepare(dist, persistent)


def test_a_stream_without_length_says_its_padding_is_unknown_instead_of_zero() -> None:
    import faccel
    from faccel.errors import ArgumentError

    # n=5, batch 2, 2 ranks: the ranks read 6 samples (sample 0 twice), so padding 0 would be false.
    ranks = [faccel.DistState.simulated(rank=r, world_size=2) for r in range(2)]
    loaders = [faccel.prepare(d, DataLoader(_Stream(5, sized=False), batch_size=2)) for d in ranks]
    assert sum(len(batch) for loader in loaders for batch in loader) == 6
    for loader in loaders:
        with pytest.raises(ArgumentError, match=r"padding is unknown.*even_batches=False"):
            loader.padding  # noqa: B018
    # With a length the padding is known; without padding (even_batches=False, drop_last) it is 0.
    sized = [faccel.prepare(d, DataLoader(_Stream(5), batch_size=2)) for d in ranks]
    assert [loader.padding for loader in sized] == [1, 1]
    for options in ({"even_batches": False}, {}):
        drop = options == {}
        uneven = [
            faccel.prepare(d, DataLoader(_Stream(5, sized=False), batch_size=2, drop_last=drop), **options)
            for d in ranks
        ]
        assert [loader.padding for loader in uneven] == [0, 0]
        assert sum(len(batch) for loader in uneven for batch in loader) == (4 if drop else 5)


def test_two_live_views_with_persistent_workers_are_refused_not_mixed() -> None:
    import faccel
    from faccel.errors import UsageError

    dist = faccel.detect({})
    data = TensorDataset(torch.arange(16))
    plain = faccel.prepare(dist, DataLoader(data, batch_size=2, shuffle=True))
    loader = faccel.prepare(
        dist, DataLoader(data, batch_size=2, shuffle=True, num_workers=1, persistent_workers=True)
    )
    epochs = [[b.tolist() for (b,) in plain.at(epoch=e)] for e in range(2)]
    # One view after the other (one left half-read) is exact.
    first = iter(loader.at(epoch=0))
    assert next(first)[0].tolist() == epochs[0][0]
    assert [[b.tolist() for (b,) in loader.at(epoch=e)] for e in range(2)] == epochs
    # Read together, the second iteration reset the DataLoader's one iterator: refused, not mixed.
    with pytest.raises(UsageError, match="persistent_workers=True the DataLoader has one iterator"):
        list(zip(loader.at(epoch=0), loader.at(epoch=1), strict=True))
    with pytest.raises(UsageError, match="another iteration of this loader started"):
        next(first)  # the half-read view too: its iterator was reset since
    assert [[b.tolist() for (b,) in loader.at(epoch=e)] for e in range(2)] == epochs


def test_set_seed_leaves_the_data_order_to_the_dist_seed() -> None:
    import faccel

    def order(dist: faccel.DistState) -> list[list[int]]:
        loader = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(12)), batch_size=3, shuffle=True))
        return [b.tolist() for (b,) in loader.at(epoch=0)]

    dist = faccel.DistState.simulated()
    faccel.set_seed(dist, 1)
    first = order(dist)
    faccel.set_seed(dist, 2)
    assert order(dist) == first  # the global generators do not decide the order...
    assert order(faccel.DistState.simulated(seed=1)) != first  # ...detect(seed=) does


def test_views_share_no_sampler_stream_or_generator() -> None:
    # every view of a prepared loader pointed one shared sampler (or stream) and
    # reseeded one shared generator. Two views of a stream read side by side (no workers) mixed
    # their positions: the stream read its start lazily, after the second view had moved it.
    import torch

    import faccel

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(8))

    dist = faccel.detect({})
    stream = faccel.prepare(dist, torch.utils.data.DataLoader(Stream(), batch_size=2))
    first, later = stream.at(epoch=0), stream.at(epoch=0, start=2)
    pairs = list(zip(first, later, strict=False))
    assert [(a.tolist(), b.tolist()) for a, b in pairs] == [([0, 1], [4, 5]), ([2, 3], [6, 7])]

    data = torch.utils.data.TensorDataset(torch.arange(10))
    loader = faccel.prepare(dist, torch.utils.data.DataLoader(data, batch_size=2, shuffle=True))
    one, two = loader.at(epoch=1), loader.at(epoch=1, start=3)
    assert one.dataloader is not two.dataloader
    assert one.dataloader.batch_sampler is not two.dataloader.batch_sampler
    assert one.dataloader.generator is not two.dataloader.generator
    both = list(zip(one, two, strict=False))
    assert [b.tolist() for (b,), _ in both] == [b.tolist() for (b,) in loader.at(epoch=1)][: len(both)]
    assert [b.tolist() for _, (b,) in both] == [b.tolist() for (b,) in loader.at(epoch=1, start=3)]
