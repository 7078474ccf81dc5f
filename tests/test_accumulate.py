from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset


@given(st.integers(0, 500), st.integers(1, 16))
def test_groups_partition_the_epoch_and_sync_at_their_ends(n: int, k: int) -> None:
    from faccel import micro_step

    steps = [micro_step(i, accumulation_steps=k, num_batches=n) for i in range(n)]
    syncs = [m.index for m in steps if m.sync]
    assert len(syncs) == -(-n // k)
    assert (syncs[-1] == n - 1) if n else not syncs
    start = 0
    for end in syncs:
        group = steps[start : end + 1]
        assert [m.sync for m in group] == [False] * (len(group) - 1) + [True]
        assert all(m.group_size == len(group) for m in group)
        assert len(group) == k or end == n - 1
        start = end + 1


class _Resumed:
    """A loader resumed at ``start`` of an epoch of ``n`` batches, as a prepared one is: it yields the
    batches from ``start`` on and its length is the whole epoch's."""

    def __init__(self, n: int, start: int) -> None:
        self.n, self.start = n, start

    def __len__(self) -> int:
        return self.n

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(range(self.start, self.n))


@given(st.integers(0, 300), st.integers(1, 16), st.data())
def test_micro_batches_hot_loop_gives_the_pure_boundarys_micro_steps(n: int, k: int, data) -> None:  # type: ignore[no-untyped-def]
    """micro_batches inlines the sync boundary for speed; it must give micro_step's records exactly,
    from any resumed position."""
    import faccel
    from faccel import micro_step

    start = data.draw(st.integers(0, n))
    dist = faccel.DistState(accumulation_steps=k)
    got = list(faccel.micro_batches(dist, _Resumed(n, start)))
    expected = [micro_step(i, accumulation_steps=k, num_batches=n) for i in range(start, n)]
    assert [m for m, _ in got] == expected and [b for _, b in got] == list(range(start, n))
    assert all(type(m) is faccel.MicroStep for m, _ in got)


def test_out_of_range_micro_steps_are_refused() -> None:
    from faccel import micro_step
    from faccel.errors import AccumulationError

    with pytest.raises(AccumulationError, match=r"\[0, 3\)"):
        micro_step(3, accumulation_steps=2, num_batches=3)
    with pytest.raises(AccumulationError, match="accumulation_steps"):
        micro_step(0, accumulation_steps=0, num_batches=3)


def _model(seed: int, width: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, width), torch.nn.Tanh(), torch.nn.Linear(width, 1))


@settings(max_examples=30)
@given(st.integers(1, 5), st.integers(1, 6), st.integers(1, 4), st.integers(1, 9), st.integers(0, 999))
def test_accumulating_k_micro_batches_equals_one_big_batch(k: int, b: int, steps: int, width: int, seed: int):
    """k micro-batches of b, accumulated, give the update of one batch of k*b; a last
    partial group of r micro-batches gives the update of one batch of r*b."""
    import faccel

    n_batches = k * steps + (k - 1 if k > 1 else 0)  # full groups and a partial one
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n_batches * b, 3, generator=g), torch.randn(n_batches * b, 1, generator=g)
    dist = faccel.DistState(accumulation_steps=k)
    model = _model(seed, width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = faccel.prepare(dist, DataLoader(TensorDataset(x, y), batch_size=b))
    for micro, (inputs, targets) in faccel.micro_batches(dist, loader):
        with faccel.accumulate(dist, model, micro):
            faccel.backward(dist, torch.nn.functional.mse_loss(model(inputs), targets), micro=micro)
        if micro.sync:
            faccel.optimizer_step(dist, optimizer)
            optimizer.zero_grad()

    reference = _model(seed, width)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for first in range(0, n_batches, k):
        rows = slice(first * b, min(first + k, n_batches) * b)
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x[rows]), y[rows]).backward()
        ref_opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_micro_batches_count_from_a_resumed_position() -> None:
    import faccel

    dist = faccel.DistState(accumulation_steps=3)
    loader = faccel.prepare(dist, DataLoader(TensorDataset(torch.arange(10)), batch_size=1))
    resumed = loader.at(epoch=0, start=7)
    got = [(m.index, m.sync, m.group_size) for m, _ in faccel.micro_batches(dist, resumed)]
    assert got == [(7, False, 3), (8, True, 3), (9, True, 1)]

    class Unsized:  # the same batches without a length: the same micro-steps
        start = 7

        def __iter__(self):
            return iter(loader.at(epoch=0, start=7))

    assert [(m.index, m.sync, m.group_size) for m, _ in faccel.micro_batches(dist, Unsized())] == got


def test_an_unsized_stream_still_syncs_its_last_partial_group() -> None:
    import faccel

    dist = faccel.DistState(accumulation_steps=4)
    got = [(m.sync, m.group_size) for m, _ in faccel.micro_batches(dist, iter(range(6)))]
    assert got == [(False, 4), (False, 4), (False, 4), (True, 4), (False, 2), (True, 2)]
    # and the same as for a sized loader of the same batches
    sized = [(m.sync, m.group_size) for m, _ in faccel.micro_batches(dist, list(range(6)))]
    assert got == sized


def test_backward_without_the_micro_step_is_refused_under_accumulation() -> None:
    import faccel

    w = torch.ones(1, requires_grad=True)
    with pytest.raises(faccel.errors.AccumulationError, match="micro_batches"):
        faccel.backward(faccel.DistState(accumulation_steps=2), w.sum())


@given(st.integers(0, 60), st.integers(1, 5), st.integers(1, 4), st.integers(1, 5))
@settings(max_examples=30, deadline=None)
def test_steps_per_epoch_counts_the_syncing_micro_steps_of_the_prepared_loader(
    n: int, batch: int, world: int, k: int
) -> None:
    import faccel

    raw = DataLoader(TensorDataset(torch.arange(float(n))), batch_size=batch)
    for rank in range(world):
        dist = faccel.DistState.simulated(rank=rank, world_size=world, accumulation_steps=k)
        loader = faccel.prepare(dist, raw)
        syncs = sum(micro.sync for micro, _ in faccel.micro_batches(dist, loader))
        assert faccel.steps_per_epoch(dist, loader) == syncs


def test_steps_per_epoch_refuses_the_loader_before_prepare() -> None:
    import faccel

    raw = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=2)
    dist = faccel.DistState.simulated(rank=0, world_size=2)
    with pytest.raises(faccel.errors.ArgumentError, match="counts the batches of every rank"):
        faccel.steps_per_epoch(dist, raw)


def test_steps_per_epoch_of_a_stream_without_length_is_refused() -> None:
    import faccel

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(5))

    dist = faccel.DistState.simulated(rank=0, world_size=2)
    loader = faccel.prepare(dist, DataLoader(Stream(), batch_size=2))
    with pytest.raises(faccel.errors.ArgumentError, match="length is unknown"):
        faccel.steps_per_epoch(dist, loader)
