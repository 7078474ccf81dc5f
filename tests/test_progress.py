"""progress(): a bar on the main process that ends at 100% however the epoch was resumed."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st


def _loader(n: int, batch_size: int, *, rank: int = 0, world_size: int = 1):  # type: ignore[no-untyped-def]
    import faccel

    data = torch.utils.data.TensorDataset(torch.arange(n))
    dist = faccel.DistState.simulated(rank=rank, world_size=world_size)
    return dist, faccel.prepare(dist, torch.utils.data.DataLoader(data, batch_size=batch_size, shuffle=True))


def _last_frame(text: str) -> str:
    return text.rstrip("\n").rsplit("\r", 1)[-1]


@given(st.integers(1, 200), st.integers(1, 16), st.data())
def test_a_resumed_epoch_starts_at_its_position_and_ends_full(
    n: int, batch_size: int, data: st.DataObject
) -> None:
    import faccel

    dist, loader = _loader(n, batch_size)
    start = data.draw(st.integers(0, len(loader)), label="start")
    view = loader.at(epoch=3, start=start)
    out = io.StringIO()
    seen = [b.tolist() for (b,) in faccel.progress(dist, view, file=out, mininterval=0)]
    assert seen == [b.tolist() for (b,) in view]  # the bar passes the batches through untouched
    assert len(seen) == len(loader) - start
    frames = out.getvalue().split("\r")
    assert f" {start}/{len(loader)} " in frames[1]  # the first frame shows the resumed position
    assert f" {len(loader)}/{len(loader)} " in _last_frame(out.getvalue())


def test_other_ranks_get_the_iterable_itself_and_print_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    import faccel

    dist, loader = _loader(10, 2, rank=1, world_size=2)
    loader = loader.at(epoch=0)  # iterated twice below: a view that names its epoch
    assert faccel.progress(dist, loader, desc="train") is loader
    expected = [b.tolist() for (b,) in loader]
    assert [b.tolist() for (b,) in faccel.progress(dist, loader)] == expected
    assert capsys.readouterr() == ("", "")


def test_the_main_process_draws_on_stderr_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    import faccel

    dist, loader = _loader(10, 2, rank=0, world_size=2)
    for _ in faccel.progress(dist, loader, desc="train"):
        pass
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "train" in captured.err
    assert f"{len(loader)}/{len(loader)}" in captured.err


def test_explicit_total_and_plain_iterables() -> None:
    import faccel

    dist = faccel.detect({})
    out = io.StringIO()
    assert list(faccel.progress(dist, range(5), file=out, mininterval=0)) == [0, 1, 2, 3, 4]
    assert " 5/5 " in _last_frame(out.getvalue())
    out = io.StringIO()
    assert list(faccel.progress(dist, iter("abc"), total=10, file=out, mininterval=0)) == ["a", "b", "c"]
    assert " 3/10 " in _last_frame(out.getvalue())


def test_a_stream_without_length_counts_without_a_total() -> None:
    import faccel

    class Stream(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(torch.arange(7))

    dist = faccel.detect({})
    loader = faccel.prepare(dist, torch.utils.data.DataLoader(Stream(), batch_size=2))
    out = io.StringIO()
    batches = list(faccel.progress(dist, loader, file=out, mininterval=0))
    assert len(batches) == 4
    assert "4it" in _last_frame(out.getvalue())


@given(st.integers(1, 60), st.integers(1, 4), st.integers(1, 5), st.data())
def test_accumulation_boundaries_are_the_same_with_and_without_the_bar(
    n: int, batch_size: int, steps: int, data: st.DataObject
) -> None:
    import attrs

    import faccel

    dist, loader = _loader(n, batch_size)
    dist = attrs.evolve(dist, accumulation_steps=steps)
    view = loader.at(epoch=1, start=data.draw(st.integers(0, len(loader)), label="start"))
    # Rank 0 iterates the bar, the others the loader itself: the micro-steps must agree.
    bare = [(m, b.tolist()) for m, (b,) in faccel.micro_batches(dist, view)]
    drawn = [
        (m, b.tolist())
        for m, (b,) in faccel.micro_batches(dist, faccel.progress(dist, view, file=io.StringIO()))
    ]
    assert drawn == bare
