"""Collectives in one process, their refusals, and the pure parts: the metrics plan and splitting.

Real two-process behaviour is in tests/distributed/test_collectives.py.
"""

from __future__ import annotations

import random
from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils.data import DataLoader, IterableDataset, TensorDataset
from typeguard import suppress_type_checks

Pair = namedtuple("Pair", ["a", "b"])


def _tree() -> dict:
    return {
        "x": torch.ones(2, 3),
        "pair": Pair(torch.zeros(2), [torch.arange(2.0), (torch.ones(2, 1),)]),
        "ordered": OrderedDict(y=torch.full((2,), 3.0)),
        "loss": torch.tensor(1.0),
    }


def _leaves(tree: object) -> list:
    from faccel._tree import flatten_with_paths

    return flatten_with_paths(tree)[0]


# --- one process: identities, no process group -------------------------------------------------


def test_one_process_collectives_communicate_nothing_and_return_the_tree() -> None:
    import torch.distributed as tdist

    import faccel

    dist = faccel.detect({})
    tree = _tree()
    for op in ("sum", "mean", "max", "min"):
        assert faccel.reduce(dist, tree, op=op) is tree
    assert faccel.broadcast(dist, tree, src=0) is tree
    assert faccel.pad_across_processes(dist, tree, dim=1, pad_first=True) is tree
    assert faccel.gather_object(dist, {"a": 1}) == [{"a": 1}]
    gathered = faccel.gather(dist, tree)
    before, after = _leaves(tree), _leaves(gathered)
    assert all(a is b for a, b in zip(before[:-1], after[:-1], strict=True))  # the same tensors
    assert after[-1].shape == (1,) and after[-1].item() == 1.0  # a 0-d leaf is one row
    assert type(gathered["pair"]) is Pair and type(gathered["ordered"]) is OrderedDict
    assert not tdist.is_initialized()


@pytest.mark.parametrize(
    "call",
    [
        lambda f, d: f.gather(d, torch.ones(1)),
        lambda f, d: f.reduce(d, torch.ones(1)),
        lambda f, d: f.broadcast(d, torch.ones(1)),
        lambda f, d: f.pad_across_processes(d, torch.ones(1)),
        lambda f, d: f.gather_object(d, 1),
    ],
    ids=["gather", "reduce", "broadcast", "pad_across_processes", "gather_object"],
)
def test_a_simulated_world_has_no_peers_to_talk_to(call) -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=1, world_size=4)
    with pytest.raises(faccel.errors.DistributedError, match=r"simulated \(rank 1 of 4, no peer processes"):
        call(faccel, dist)


def test_a_simulated_world_refuses_gather_for_metrics_too() -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=0, world_size=2)
    loader = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(4)), batch_size=2))
    with pytest.raises(faccel.errors.DistributedError, match="simulated"):
        faccel.gather_for_metrics(dist, torch.ones(2), loader, batch=0)


def test_a_multi_process_state_without_a_running_group_is_refused() -> None:
    import faccel

    dist = faccel.detect(
        {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, start=False
    )
    with pytest.raises(faccel.errors.DistributedError, match="needs a running process group"):
        faccel.gather(dist, torch.ones(1))


def test_leaves_must_be_tensors_and_the_message_names_the_leaf() -> None:
    import faccel

    dist = faccel.detect({})
    for fn in (faccel.gather, faccel.reduce, faccel.broadcast, faccel.pad_across_processes):
        with pytest.raises(faccel.errors.ArgumentError, match=r"tree\['meta'\]\[1\] is str"):
            fn(dist, {"x": torch.ones(1), "meta": [torch.ones(1), "id"]})


def test_reduce_and_broadcast_check_their_options() -> None:
    import faccel

    dist = faccel.detect({})
    # What a user sees: the suite's own type checker (typeguard's import hook) would name it first.
    with pytest.raises(faccel.errors.ArgumentValueError, match="op must be one of"), suppress_type_checks():
        faccel.reduce(dist, torch.ones(1), op="avg")  # type: ignore[arg-type]
    with pytest.raises(faccel.errors.ArgumentError, match=r"op='mean' divides .* tree\[0\] is torch.int64"):
        faccel.reduce(dist, [torch.arange(3)], op="mean")
    assert faccel.reduce(dist, [torch.arange(3)], op="max")[0].tolist() == [0, 1, 2]
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"src must be a rank in \[0, 1\), got 1"):
        faccel.broadcast(dist, torch.ones(1), src=1)


# --- the metrics plan: pure, for any world size ----------------------------------------------------


@st.composite
def plans(draw: st.DrawFn, *, max_samples: int = 3000, max_world: int = 64) -> dict:
    return {
        "num_samples": draw(st.integers(0, max_samples)),
        "batch_size": draw(st.integers(1, 64)),
        "world_size": draw(st.integers(1, max_world)),
        "shuffle": draw(st.booleans()),
        "drop_last": draw(st.booleans()),
        "even_batches": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
    }


def _real(sharding) -> list[int]:
    """Positions that are real samples: all of them, each once (under drop_last, complete rounds)."""
    return list(range(min(sharding.total, sharding.num_samples)))


@given(plans())
def test_plan_for_a_whole_epoch_keeps_each_sample_once_in_position_order(kwargs: dict) -> None:
    import faccel
    from faccel._data._metrics import metrics_plan

    sharding = faccel.Sharding(**kwargs)
    per_rank = [sharding.positions(r) for r in range(sharding.world_size)]
    gathered = torch.cat(per_rank)  # what each rank computed, rank 0's rows first
    rows, positions = metrics_plan(sharding, [len(p) for p in per_rank])
    assert gathered[rows].tolist() == positions.tolist() == _real(sharding)


@given(plans(max_samples=400, max_world=12), st.integers(0, 5))
def test_plan_per_batch_concatenates_to_the_whole_epoch(kwargs: dict, start: int) -> None:
    import faccel
    from faccel._data._metrics import metrics_plan

    sharding = faccel.Sharding(**kwargs)
    b, world = sharding.batch_size, sharding.world_size
    batches = -(-len(sharding.positions(0)) // b)
    got = []
    for k in range(batches):
        per_rank = [sharding.positions(r)[k * b : (k + 1) * b] for r in range(world)]
        rows, positions = metrics_plan(sharding, [len(p) for p in per_rank], batch=k)
        assert torch.cat(per_rank)[rows].tolist() == positions.tolist()
        got += positions.tolist()
    assert got == _real(sharding)
    # From batch `start` on (a resumed view): the same positions as those batches, in order.
    tail = [sharding.positions(r)[start * b :] for r in range(world)]
    rows, positions = metrics_plan(sharding, [len(t) for t in tail], start=start)
    assert positions.tolist() == sorted(p for t in tail for p in t.tolist() if p < sharding.num_samples)


@given(plans(max_samples=200, max_world=8), st.data())
def test_plan_refuses_row_counts_that_do_not_match_the_loader(kwargs: dict, data: st.DataObject) -> None:
    import faccel
    from faccel._data._metrics import metrics_plan

    sharding = faccel.Sharding(**kwargs)
    counts = [len(sharding.positions(r)) for r in range(sharding.world_size)]
    rank = data.draw(st.integers(0, sharding.world_size - 1))
    counts[rank] += data.draw(st.sampled_from([-1, 1])) if counts[rank] else 1
    with pytest.raises(faccel.errors.ArgumentValueError, match=f"rank {rank} gave {counts[rank]} rows"):
        metrics_plan(sharding, counts)


def test_plan_refuses_a_batch_outside_the_epoch() -> None:
    import faccel
    from faccel._data._metrics import metrics_plan

    sharding = faccel.Sharding(num_samples=5, batch_size=2, world_size=2)
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"batch must be .* in \[0, 2\)"):
        metrics_plan(sharding, [0, 0], batch=2)
    with pytest.raises(faccel.errors.ArgumentValueError, match="one row count per rank"):
        metrics_plan(sharding, [3])


@given(
    st.integers(0, 40),
    st.integers(1, 5),
    st.integers(1, 6),
    st.booleans(),
    st.booleans(),
    st.booleans(),
    st.integers(0, 3),
)
def test_simulated_ranks_through_the_real_loader_give_back_the_dataset(
    n: int, b: int, world: int, shuffle: bool, even: bool, drop_last: bool, epoch: int
) -> None:
    """Every rank's outputs, made by simulated ranks iterating prepared loaders, merge to the epoch."""
    import faccel
    from faccel._data._metrics import metrics_plan

    data = TensorDataset(torch.arange(n) * 10)
    loaders = [
        faccel.prepare(
            faccel.DistState.simulated(rank=r, world_size=world, seed=5),
            # torch's RandomSampler refuses an empty dataset
            DataLoader(data, batch_size=b, shuffle=shuffle and n > 0, drop_last=drop_last),
            even_batches=even,
        ).at(epoch=epoch)
        for r in range(world)
    ]
    outputs = [[batch for (batch,) in loader] for loader in loaders]
    sharding = loaders[0].sharding
    expected = (sharding.order(epoch) * 10)[: min(sharding.total, n)].tolist()
    # once, on each rank's concatenated outputs
    per_rank = [torch.cat(o) if o else torch.empty(0, dtype=torch.long) for o in outputs]
    rows, positions = metrics_plan(sharding, [len(p) for p in per_rank])
    assert torch.cat(per_rank)[rows].tolist() == expected
    assert (sharding.order(epoch)[positions] * 10).tolist() == expected
    # per batch; under even_batches=False a rank without batch k contributes no rows
    got = []
    for k in range(max(len(o) for o in outputs)):
        batch_k = [o[k] if k < len(o) else torch.empty(0, dtype=torch.long) for o in outputs]
        rows, _ = metrics_plan(sharding, [len(x) for x in batch_k], batch=k)
        got += torch.cat(batch_k)[rows].tolist()
    assert got == expected


# --- gather_for_metrics in one process ----------------------------------------------------------


@pytest.mark.parametrize("n", [7, 10, 13])
@pytest.mark.parametrize("b", [2, 3])
def test_gather_for_metrics_in_one_process_returns_the_dataset(n: int, b: int) -> None:
    import faccel

    dist = faccel.detect({})
    loader = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(n)), batch_size=b))
    per_batch = [
        faccel.gather_for_metrics(dist, {"i": x}, loader, batch=k)["i"] for k, (x,) in enumerate(loader)
    ]
    assert torch.cat(per_batch).tolist() == list(range(n))
    whole = torch.cat([x for (x,) in loader])
    assert faccel.gather_for_metrics(dist, whole, loader).tolist() == list(range(n))
    resumed = loader.at(epoch=0, start=1)
    rest = torch.cat([x for (x,) in resumed])
    assert faccel.gather_for_metrics(dist, rest, resumed).tolist() == list(range(b, n))


def test_gather_for_metrics_under_shuffle_gives_the_epoch_order_and_indices() -> None:
    import faccel

    dist = faccel.detect({}, seed=3)
    data = TensorDataset(torch.arange(9) * 2)
    loader = faccel.prepare(dist, DataLoader(data, batch_size=4, shuffle=True)).at(epoch=1)
    outputs = torch.cat([x for (x,) in loader])
    rows, indices = faccel.gather_for_metrics(dist, outputs, loader, with_indices=True)
    assert indices.tolist() == loader.sharding.order(1).tolist()
    assert rows.tolist() == (indices * 2).tolist()


def test_gather_for_metrics_explains_wrong_rows() -> None:
    import faccel

    dist = faccel.detect({})
    loader = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(5)), batch_size=2))
    with pytest.raises(
        faccel.errors.ArgumentValueError, match="rank 0 gave 3 rows but its share of batch 1 holds 2"
    ):
        faccel.gather_for_metrics(dist, torch.ones(3), loader, batch=1)
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"dim 0 differs \(tree\[0\]: 2, tree\[1\]: 1"):
        faccel.gather_for_metrics(dist, [torch.ones(2), torch.ones(1)], loader, batch=0)
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"in \[0, 3\)"):
        faccel.gather_for_metrics(dist, torch.ones(1), loader, batch=3)


class _Unsized(IterableDataset):
    def __iter__(self):
        return iter(range(4))


def test_gather_for_metrics_needs_a_dataset_length() -> None:
    import faccel

    dist = faccel.detect({})
    loader = faccel.prepare(dist, DataLoader(_Unsized(), batch_size=2))
    with pytest.raises(faccel.errors.ArgumentValueError, match="no length"):
        faccel.gather_for_metrics(dist, torch.ones(2), loader, batch=0)


# --- split_between_processes ----------------------------------------------------------------------


@given(st.lists(st.integers(-(2**31), 2**31), max_size=60), st.integers(1, 64))
def test_shares_partition_the_items_in_order(items: list, world: int) -> None:
    import faccel

    shares = [
        faccel.split_between_processes(faccel.DistState.simulated(rank=r, world_size=world), items)
        for r in range(world)
    ]
    assert [x for share in shares for x in share] == items
    lengths = [len(s) for s in shares]
    assert max(lengths) - min(lengths) <= 1 and lengths == sorted(lengths, reverse=True)
    tensor_shares = [
        faccel.split_between_processes(
            faccel.DistState.simulated(rank=r, world_size=world), torch.tensor(items)
        )
        for r in range(world)
    ]
    assert torch.cat(tensor_shares).tolist() == items
    as_tuple = faccel.split_between_processes(
        faccel.DistState.simulated(rank=0, world_size=world), tuple(items)
    )
    assert as_tuple == tuple(shares[0])


@given(st.lists(st.integers(-(2**31), 2**31), max_size=60), st.integers(1, 64))
def test_padded_shares_are_equally_long_and_repeat_the_last_item(items: list, world: int) -> None:
    import faccel

    for r in range(world):
        dist = faccel.DistState.simulated(rank=r, world_size=world)
        plain = faccel.split_between_processes(dist, items)
        padded = faccel.split_between_processes(dist, items, pad=True)
        assert len(padded) == -(-len(items) // world)
        assert padded[: len(plain)] == plain
        assert all(x == items[-1] for x in padded[len(plain) :])
        padded_tensor = faccel.split_between_processes(dist, torch.tensor(items).reshape(-1, 1), pad=True)
        assert padded_tensor.flatten().tolist() == padded


def test_split_a_dict_of_lists_alike_and_refuse_what_cannot_be_split() -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=1, world_size=2)
    items = {"prompt": ["a", "b", "c"], "id": torch.arange(3)}
    share = faccel.split_between_processes(dist, items, pad=True)
    assert share["prompt"] == ["c", "c"] and share["id"].tolist() == [2, 2]
    assert type(faccel.split_between_processes(dist, OrderedDict(items))) is OrderedDict
    with pytest.raises(faccel.errors.ArgumentValueError, match="need one length"):
        faccel.split_between_processes(dist, {"a": [1, 2], "b": [1]})
    with pytest.raises(faccel.errors.ArgumentError, match="character by character"):
        faccel.split_between_processes(dist, "abc")
    with pytest.raises(faccel.errors.ArgumentError, match="0-d tensor"):
        faccel.split_between_processes(dist, torch.tensor(1.0))
    with pytest.raises(faccel.errors.ArgumentError):
        faccel.split_between_processes(dist, 3)  # type: ignore[arg-type]


# --- set_seed ----------------------------------------------------------------------------------------


def _draw() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(1).item()


def test_set_seed_makes_python_numpy_and_torch_repeat() -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=2, world_size=4)
    assert faccel.set_seed(dist, 11) == 11
    first = _draw()
    faccel.set_seed(dist, 11)
    assert _draw() == first
    assert faccel.set_seed(dist, 11, per_rank=True) == 13
    other_rank = _draw()
    assert other_rank != first
    faccel.set_seed(faccel.DistState.simulated(rank=0, world_size=4), 13)
    assert _draw() == other_rank  # per_rank means seed + rank, nothing hidden


def test_set_seed_refuses_seeds_numpy_cannot_take() -> None:
    import faccel

    dist = faccel.DistState.simulated(rank=1, world_size=2)
    with pytest.raises(faccel.errors.ArgumentValueError, match=r"2\*\*32"):
        faccel.set_seed(dist, 2**32 - 1, per_rank=True)
    with pytest.raises(faccel.errors.ArgumentValueError):
        faccel.set_seed(dist, -1)
