"""Every DataLoader form prepare() shards: custom samplers, batch samplers, batch_size=None, split_batches.

Each form's law is checked on simulated ranks: every rank draws the same epoch order
(from (seed, epoch), no communication), the ranks' shares cover that order once plus
the reported padding, and a resumed view is a suffix of the straight one.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from tests.strategies import sampler_forms


class LengthGrouped(Sampler[list[int]]):
    """Batches of similar length (the usual text bucketing): shuffle, sort in chunks, shuffle batches."""

    def __init__(self, lengths: list[int], batch_size: int, generator: torch.Generator | None = None) -> None:
        self.lengths, self.batch_size, self.generator = lengths, batch_size, generator

    def __iter__(self):
        order = torch.randperm(len(self.lengths), generator=self.generator).tolist()
        order.sort(key=lambda i: self.lengths[i])
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        shuffled = torch.randperm(len(batches), generator=self.generator).tolist()
        return iter([batches[i] for i in shuffled])

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)


class EpochSampler(Sampler[int]):
    """Decides its order from set_epoch, as DistributedSampler and many bucketing samplers do."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(random.Random(self.epoch).sample(range(self.n), self.n))

    def __len__(self) -> int:
        return self.n


class GlobalRandom(Sampler[int]):
    """Draws from the global torch generator, with no hook at all."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class Hidden(Sampler[int]):
    """Keeps its own generator under another name and advances it: hidden state."""

    def __init__(self, n: int) -> None:
        self.n, self.rng = n, random.Random(0)

    def __iter__(self):
        return iter(self.rng.sample(range(self.n), self.n))

    def __len__(self) -> int:
        return self.n


def _views(make, world: int, epoch: int = 0, **options):
    import faccel

    loaders = [
        faccel.prepare(faccel.DistState.simulated(rank=r, world_size=world, seed=5), make(), **options)
        for r in range(world)
    ]
    return loaders, [[b[0].tolist() for b in loader.at(epoch=epoch)] for loader in loaders]


def _dealt(per_rank: list[list[list[int]]]) -> list[int]:
    """The samples in dealing order: batch k of rank 0, of rank 1, ... (batch-level round robin)."""
    out = []
    for k in range(max(map(len, per_rank))):
        for batches in per_rank:
            if k < len(batches):
                out.extend(batches[k])
    return out


DATA = TensorDataset(torch.arange(23))


@pytest.mark.parametrize(
    "make",
    [
        lambda: DataLoader(DATA, batch_size=3, sampler=WeightedRandomSampler([1.0] * 20 + [9.0] * 3, 17)),
        lambda: DataLoader(DATA, batch_size=3, sampler=RandomSampler(DATA, replacement=True)),
        lambda: DataLoader(DATA, batch_size=3, sampler=RandomSampler(DATA, num_samples=30)),
        lambda: DataLoader(DATA, batch_size=3, sampler=SubsetRandomSampler(range(0, 23, 2))),
        lambda: DataLoader(DATA, batch_size=3, sampler=EpochSampler(23)),
        lambda: DataLoader(DATA, batch_size=3, sampler=GlobalRandom(23)),
        lambda: DataLoader(DATA, batch_size=3, sampler=list(range(22, -1, -1))),
    ],
    ids=["weighted", "replacement", "num_samples", "subset", "set_epoch", "global_rng", "a_list"],
)
def test_a_custom_sampler_is_drawn_from_seed_and_epoch_and_dealt_like_the_default(make) -> None:
    for epoch in (0, 3):
        loaders, per_rank = _views(make, world=3, epoch=epoch)
        order = loaders[0].sharding.order(epoch).tolist()
        # Every rank computed the same order (the draw is a function of (seed, epoch)).
        assert all(loader.sharding.order(epoch).tolist() == order for loader in loaders)
        for rank, loader in enumerate(loaders):
            assert per_rank[rank] == loader.sharding.batches(epoch)
            assert [b[0].tolist() for b in loader.at(epoch=epoch, start=1)] == per_rank[rank][1:]
        # Positions 0, 1, 2 of the order open the first batches of ranks 0, 1, 2.
        assert [batches[0][0] for batches in per_rank] == order[:3]
        samples = sorted(x for batches in per_rank for b in batches for x in b)
        padding = loaders[0].padding
        assert len(samples) == len(order) + padding
        assert sorted(order + order[:padding]) == samples
    # A new loader (a restarted job) draws the same: the order is a function of (seed, epoch).
    assert _views(make, world=3, epoch=1)[1] == _views(make, world=3, epoch=1)[1]


def test_samplers_draw_without_touching_the_global_generators() -> None:
    torch.manual_seed(0)
    random.seed(0)
    expected = (torch.rand(2), random.random())
    torch.manual_seed(0)
    random.seed(0)
    _views(lambda: DataLoader(DATA, batch_size=2, sampler=GlobalRandom(23)), world=2, epoch=2)
    _views(lambda: DataLoader(DATA, batch_size=2, sampler=EpochSampler(23)), world=2, epoch=2)
    assert (torch.rand(2), random.random())[1] == expected[1]
    torch.manual_seed(0)
    _views(lambda: DataLoader(DATA, batch_size=2, sampler=GlobalRandom(23)), world=2, epoch=2)
    assert torch.equal(torch.rand(2), expected[0])


def test_a_sampler_with_hidden_state_is_refused_by_name() -> None:
    import faccel
    from faccel.errors import PrepareError

    with pytest.raises(PrepareError, match=r"hidden state.*`generator` attribute.*set_epoch"):
        faccel.prepare(faccel.detect({}), DataLoader(DATA, batch_size=2, sampler=Hidden(23)))


def test_a_distributed_sampler_is_refused_with_the_fix() -> None:
    import faccel
    from faccel.errors import PrepareError

    sampler = DistributedSampler(DATA, num_replicas=2, rank=1, shuffle=True)
    with pytest.raises(PrepareError, match=r"DistributedSampler \(rank 1 of 2\).*shuffle=True"):
        faccel.prepare(faccel.detect({}), DataLoader(DATA, batch_size=2, sampler=sampler))
    wrapped = BatchSampler(sampler, 2, False)

    class Mine(BatchSampler):
        pass

    with pytest.raises(PrepareError, match="DistributedSampler"):
        faccel.prepare(faccel.detect({}), DataLoader(DATA, batch_sampler=Mine(sampler, 2, False)))
    with pytest.raises(PrepareError, match="DistributedSampler"):
        faccel.prepare(faccel.detect({}), DataLoader(DATA, batch_sampler=wrapped))


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_a_batch_sampler_is_dealt_whole_with_batch_level_padding(even: bool, world: int) -> None:
    lengths = [(7 * i) % 11 + 1 for i in range(23)]

    def make():
        return DataLoader(DATA, batch_sampler=LengthGrouped(lengths, 4, torch.Generator()))

    for epoch in (0, 1):
        loaders, per_rank = _views(make, world=world, epoch=epoch, even_batches=even)
        global_batches = loaders[0].sharding._drawn(epoch)
        assert len(global_batches) == 6
        # Dealt whole, in order: batch q goes to rank q % world.
        dealt = [per_rank[q % world][q // world] for q in range(6)]
        assert dealt == global_batches
        padding = loaders[0].padding
        counts = [len(b) for b in per_rank]
        if even:
            assert len(set(counts)) == 1 and padding == -6 % world
            extra = [b for r in range(world) for b in per_rank[r][len(per_rank[r]) :]]
            assert extra == []
            # The padding batches repeat the epoch's first batches.
            tail = [per_rank[q % world][q // world] for q in range(6, 6 + padding)]
            assert tail == global_batches[:padding]
        else:
            assert padding == 0 and sum(counts) == 6 and max(counts) - min(counts) <= 1
        assert all(loader.batch_size is None for loader in loaders)
        for rank, loader in enumerate(loaders):
            assert [b[0].tolist() for b in loader.at(epoch=epoch, start=1)] == per_rank[rank][1:]
            assert len(loader) == len(per_rank[rank])


def test_batch_size_none_deals_the_items_whole() -> None:
    class Prebatched(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 5

        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.full((i + 1,), i)

    loaders, _ = _views(lambda: DataLoader(Prebatched(), batch_size=None), world=2)
    got = [[b.tolist() for b in loader] for loader in loaders]
    assert got == [[[0], [2, 2, 2], [4, 4, 4, 4, 4]], [[1, 1], [3, 3, 3, 3], [0]]]
    assert [loader.padding for loader in loaders] == [1, 1] and loaders[0].batch_size is None
    shuffled, _ = _views(lambda: DataLoader(Prebatched(), batch_size=None, shuffle=True), world=2, epoch=1)
    items = [int(b[0]) for loader in shuffled for b in loader.at(epoch=1)]
    assert len(items) == 6 and set(items) == set(range(5))


def test_split_batches_keeps_the_global_batch_whatever_the_world_size() -> None:
    import faccel
    from faccel.errors import PrepareError

    def make():
        return DataLoader(TensorDataset(torch.arange(40)), batch_size=8, shuffle=True)

    single = [
        set(b[0].tolist()) for b in faccel.prepare(faccel.DistState.simulated(seed=5), make()).at(epoch=2)
    ]
    for world in (1, 2, 4, 8):
        loaders, per_rank = _views(make, world=world, epoch=2, split_batches=True)
        assert loaders[0].batch_size == 8 // world
        merged = [set().union(*(per_rank[r][k] for r in range(world))) for k in range(len(per_rank[0]))]
        assert merged == single
    with pytest.raises(PrepareError, match=r"batch_size=8 is not divisible by 3"):
        _views(make, world=3, split_batches=True)
    with pytest.raises(PrepareError, match="split_batches"):
        _views(
            lambda: DataLoader(DATA, batch_sampler=LengthGrouped([1] * 23, 4)), world=2, split_batches=True
        )


def test_worker_seeds_must_be_a_known_mode() -> None:
    import faccel
    from faccel.errors import ArgumentValueError

    with pytest.raises(ArgumentValueError, match="worker_seeds must be one of"):
        faccel.prepare(faccel.detect({}), DataLoader(DATA, batch_size=2), worker_seeds="off")


@given(sampler_forms(max_world=256), st.integers(0, 3), st.data())
@settings(max_examples=60, deadline=None)
def test_each_form_covers_its_order_once_plus_padding_and_resumes_as_a_suffix(form, epoch, data) -> None:
    form_law(form, epoch, data)


def form_law(form: dict, epoch: int, data) -> None:
    """One form's law (scripts/prove_data_forms.py runs it with many more examples)."""
    import faccel

    shardings = [faccel.Sharding(rank=r, **form) for r in range(form["world_size"])]
    first = shardings[0]
    per_rank = [s.batches(epoch) for s in shardings]
    units = first._drawn(epoch) if first.whole_batches else first.order(epoch).tolist()
    n = len(units)
    assert n == form["num_samples"]
    # Dealt in order: position p went to rank p % world, as its batch p // (world * b).
    w, b = first.world_size, first.batch_size
    dealt = []
    for p in range(first.total):
        batches = per_rank[p % w]
        k, j = divmod(p // w, b)
        dealt.append(batches[k] if first.whole_batches else batches[k][j])
    assert dealt == [units[p % n] for p in range(first.total)] if n else dealt == []
    if first.drop_last:
        assert first.total == n - n % (w * b) and first.padding == 0
    elif first.even_batches:
        assert len({len(x) for x in per_rank}) <= 1 and first.padding < w * b
    else:
        assert first.padding == 0 and first.total == n
    rank = data.draw(st.integers(0, w - 1))
    start = data.draw(st.integers(0, len(per_rank[rank]) + 1))
    assert shardings[rank].batches(epoch, start=start) == per_rank[rank][start:]


def test_gather_for_metrics_keeps_object_columns_exact_like_tensors() -> None:
    import faccel

    dist = faccel.detect({})
    loader = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(5)), batch_size=2))
    outs = [
        faccel.gather_for_metrics(
            dist, {"x": x, "text": [f"s{int(v)}" for v in x], "ids": (1,) * len(x)}, loader, batch=k
        )
        for k, (x,) in enumerate(loader)
    ]
    assert [o["text"] for o in outs] == [["s0", "s1"], ["s2", "s3"], ["s4"]]
    assert all(isinstance(o["ids"], tuple) for o in outs)
    with pytest.raises(faccel.errors.ArgumentError, match="JSON"):
        faccel.gather_for_metrics(dist, [object(), object()], loader, batch=0)


def test_gather_for_metrics_with_a_loader_it_did_not_prepare_says_what_to_do() -> None:
    import faccel

    dist = faccel.detect({})
    plain = DataLoader(TensorDataset(torch.arange(4)), batch_size=2)
    # Before: AttributeError: 'DataLoader' object has no attribute 'epoch'.
    with pytest.raises(
        faccel.errors.ArgumentError, match=r"got a DataLoader.*Prepare the DataLoader.*faccel\.gather"
    ):
        faccel.gather_for_metrics(dist, torch.ones(2), plain, batch=0)


def test_a_stream_without_length_gathers_exactly_without_padding() -> None:
    import faccel

    class Unsized(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(7))

    dist = faccel.detect({})
    loader = faccel.prepare(dist, DataLoader(Unsized(), batch_size=3), even_batches=False)
    outs = [faccel.gather_for_metrics(dist, x, loader, batch=k) for k, x in enumerate(loader)]
    assert torch.cat(outs).tolist() == list(range(7))
    padded = faccel.prepare(dist, DataLoader(Unsized(), batch_size=3))
    with pytest.raises(faccel.errors.ArgumentValueError, match="even_batches=False"):
        faccel.gather_for_metrics(dist, next(iter(padded)), padded, batch=0)


def test_batch_size_none_gathers_per_batch_and_says_so_for_the_whole_epoch() -> None:
    import faccel

    dist = faccel.detect({})
    loader = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(3)), batch_size=None))
    outs = [faccel.gather_for_metrics(dist, x.reshape(1), loader, batch=k) for k, (x,) in enumerate(loader)]
    assert torch.cat(outs).tolist() == [0, 1, 2]
    with pytest.raises(faccel.errors.ArgumentValueError, match="once per batch"):
        faccel.gather_for_metrics(dist, torch.arange(3), loader)


def test_an_iterable_dataset_without_batching_or_with_split_batches_is_dealt_like_a_map() -> None:
    import faccel

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(torch.arange(7))

    per_rank = []
    for rank in range(2):
        dist = faccel.DistState.simulated(rank=rank, world_size=2)
        items = faccel.prepare(dist, DataLoader(Stream(), batch_size=None))
        split = faccel.prepare(dist, DataLoader(Stream(), batch_size=4), split_batches=True)
        assert items.batch_size is None and split.batch_size == 2
        per_rank.append(([int(x) for x in items], [b.tolist() for b in split]))
    assert [p[0] for p in per_rank] == [[0, 2, 4, 6], [1, 3, 5, 0]]
    assert [p[1] for p in per_rank] == [[[0, 2], [4, 6]], [[1, 3], [5]]]  # 2 batches each: no padding
    with pytest.raises(faccel.errors.PrepareError, match="divisible"):
        faccel.prepare(
            faccel.DistState.simulated(rank=0, world_size=3),
            DataLoader(Stream(), batch_size=4),
            split_batches=True,
        )


def test_uneven_inputs_refuses_accumulation() -> None:
    import faccel

    model = torch.nn.Linear(2, 1)
    context = faccel.uneven_inputs(faccel.DistState(accumulation_steps=2), model)
    with pytest.raises(faccel.errors.UsageError, match="accumulation_steps=2"):
        context.__enter__()
