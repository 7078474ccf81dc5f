"""The meter, the FLOP count and the straggler rule: laws of the pure parts, one process.

The two-rank runs (a slow rank named, a stopped rank named in a timeout) are in
tests/distributed/test_observe.py; the plot's PNG and HTML in tests/test_observe_plot.py.
"""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import faccel
from faccel._dist._hangs import MAX_RECORD_BYTES, HangRecord, read_record, write_record
from faccel._dist._process_group import breadcrumb
from faccel._report._flops import count_flops, device_peak_flops, transformer_flops
from faccel._report._meter import Meter, advance
from faccel._report._stragglers import slow_ranks
from faccel._report._tracking import METER_NAMES
from faccel.errors import ArgumentValueError
from tests.strategies import meter_steps, rank_times


def _run(steps: list[tuple[int, float]], *, start: float = 0.0) -> list[Meter]:
    meter, now, out = Meter.create(started=start), start, []
    for items, seconds in steps:
        now += seconds
        meter = advance(meter, items=items, now=now, memory=items)
        out.append(meter)
    return out


@given(meter_steps())
def test_the_run_rate_is_the_items_over_the_time_and_each_step_rate_its_own(
    steps: list[tuple[int, float]],
) -> None:
    meters = _run(steps)
    last = meters[-1]
    total_items, total_time = sum(i for i, _ in steps), sum(s for _, s in steps)
    assert last.step == len(steps) and last.items == total_items
    assert math.isclose(last.run_items_per_second, total_items / total_time, rel_tol=1e-9)
    for meter, (items, _) in zip(meters, steps, strict=True):
        assert math.isclose(meter.items_per_second * meter.step_seconds, items, rel_tol=1e-9, abs_tol=1e-9)
    # The peak memory is the largest seen so far, never less.
    assert [m.memory_bytes for m in meters] == [max(i for i, _ in steps[: k + 1]) for k in range(len(steps))]


@given(meter_steps(), st.floats(min_value=0.01, max_value=100.0))
def test_a_slower_clock_divides_every_rate_by_its_factor(steps: list[tuple[int, float]], c: float) -> None:
    fast = _run(steps)[-1]
    slow = _run([(items, seconds * c) for items, seconds in steps])[-1]
    assert math.isclose(slow.run_items_per_second * c, fast.run_items_per_second, rel_tol=1e-6)
    assert math.isclose(slow.items_per_second * c, fast.items_per_second, rel_tol=1e-6)


@given(meter_steps(), st.floats(min_value=1.0, max_value=1e6), st.floats(min_value=1e3, max_value=1e15))
def test_mfu_is_the_model_flops_per_second_over_the_peak(
    steps: list[tuple[int, float]], flops: float, peak: float
) -> None:
    meter = Meter.create(started=0.0, flops_per_item=flops, peak_flops=peak)
    now = 0.0
    for items, seconds in steps:
        now += seconds
        meter = advance(meter, items=items, now=now)
    assert meter.mfu is not None
    assert math.isclose(meter.mfu * peak, flops * meter.items_per_second, rel_tol=1e-9)
    assert Meter.create(started=0.0).mfu is None  # no FLOPs, no MFU: left out, not zero
    assert METER_NAMES["mfu"] in meter.metrics()


def test_the_forward_time_is_the_part_before_the_last_backward() -> None:
    meter = advance(Meter.create(started=1.0), items=4, now=3.0, backward_at=2.5)
    assert meter.forward_seconds == 1.5 and meter.window_seconds == 1.5
    # A backward from before this step (none in it) says nothing about it: the whole step counts.
    meter = advance(meter, items=4, now=4.0, backward_at=2.5)
    assert meter.forward_seconds is None and meter.window_seconds == 2.5
    with pytest.raises(ArgumentValueError, match="ends after the last one"):
        advance(meter, items=1, now=3.0)
    with pytest.raises(ArgumentValueError, match="items >= 0"):
        advance(meter, items=-1, now=5.0)


def test_the_meter_on_this_process_reads_the_clock_and_the_peak_rss() -> None:
    dist = faccel.detect({})
    meter = faccel.start_meter(dist)
    model = torch.nn.Linear(4, 1)
    faccel.backward(dist, model(torch.ones(2, 4)).sum())
    meter = faccel.measure(dist, meter, items=2)
    assert meter.spec.memory_source == "rss" and meter.memory_bytes and meter.memory_bytes > 1 << 20
    assert meter.forward_seconds is not None and 0 <= meter.forward_seconds <= meter.step_seconds
    assert meter.eta(10) > 0
    assert dist.runtime.phase == "forward"  # the next step begins: what a hang record would say


def test_measure_adds_in_place_what_advance_makes_anew_from_the_same_readings() -> None:
    dist = faccel.detect({})
    model = torch.nn.Linear(4, 1)
    meter = faccel.start_meter(dist)
    pure, kept = meter.copy(), []
    for step in range(6):
        if step % 2:  # steps with and without a backward: forward time known, then not
            faccel.backward(dist, model(torch.ones(2, 4)).sum())
        before = meter.last
        assert faccel.measure(dist, meter, items=step) is meter  # the loop's own meter, updated
        backward_at = dist.runtime.backward_at
        # The same step, pure, from what measure read: its clock, the backward's start, the memory.
        pure = advance(pure, items=step, now=meter.last, memory=meter.memory_bytes, backward_at=backward_at)
        kept.append(pure)
        assert meter.step_seconds == meter.last - before
    fields = ("last", "step", "items", "step_items", "step_seconds", "forward_seconds", "window_seconds")
    assert [getattr(pure, f) for f in fields] == [getattr(meter, f) for f in fields]
    assert pure.window_steps == meter.window_steps and pure.memory_bytes == meter.memory_bytes
    assert [m.step for m in kept] == list(range(1, 7))  # each advance made its own, left as it was
    assert meter.forward_seconds is not None and kept[-2].forward_seconds is None


@given(rank_times, st.floats(min_value=1.01, max_value=10.0))
def test_the_straggler_rule_is_about_ratios_and_names_fewer_than_half(
    times: list[float], factor: float
) -> None:
    slow = slow_ranks(times, factor)
    median = sorted(times)[(len(times) - 1) // 2]  # the lower median
    assert set(slow) == {r for r, t in enumerate(times) if t > factor * median}
    assert len(slow) <= len(times) // 2  # those above the lower median are at most half
    assert [times[r] for r in slow] == sorted((times[r] for r in slow), reverse=True)
    # The same at any clock, and a larger factor names a subset.
    assert slow_ranks([t * 3.0 for t in times], factor) == slow
    assert set(slow_ranks(times, factor * 1.5)) <= set(slow)
    assert slow_ranks([times[0]] * len(times), factor) == ()


def test_the_straggler_rule_refuses_a_factor_that_names_everyone() -> None:
    with pytest.raises(ArgumentValueError, match="factor must be > 1"):
        slow_ranks([1.0, 2.0], 1.0)


class _Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.out = torch.nn.Linear(width, width, bias=False)
        self.up = torch.nn.Linear(width, 4 * width, bias=False)
        self.down = torch.nn.Linear(4 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # Attention by hand: torch's counter has no formula for SDPA's CPU kernel (it counts 0 there).
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.down(torch.relu(self.up(x)))


def _decoder(vocab: int, width: int, heads: int, layers: int) -> torch.nn.Module:
    blocks = [_Block(width, heads) for _ in range(layers)]
    return torch.nn.Sequential(
        torch.nn.Embedding(vocab, width), *blocks, torch.nn.Linear(width, vocab, bias=False)
    )


@settings(max_examples=3, deadline=None)
@given(
    st.integers(2, 24),  # vocab
    st.integers(1, 3),  # heads
    st.integers(1, 4),  # head size
    st.integers(1, 2),  # layers
    st.integers(1, 8),  # seq_len
    st.integers(1, 3),  # batch
)
def test_the_transformer_formula_is_what_the_flop_counter_counts(
    vocab: int, heads: int, head: int, layers: int, seq_len: int, batch: int
) -> None:
    width = heads * head
    model = _decoder(vocab, width, heads, layers)
    tokens = torch.randint(0, vocab, (batch, seq_len))
    _, counted = count_flops(lambda: model(tokens).sum().backward())
    params = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("0."))
    per_token = transformer_flops(params=params, layers=layers, width=width, seq_len=seq_len)
    assert counted == per_token * batch * seq_len


@settings(max_examples=6, deadline=None)
@given(st.lists(st.integers(1, 16), min_size=2, max_size=4), st.integers(1, 8))
def test_an_mlp_counts_six_flops_per_weight_per_sample(sizes: list[int], batch: int) -> None:
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(sizes)]
    model = torch.nn.Sequential(*layers)
    x = torch.randn(batch, sizes[0], requires_grad=True)  # its gradient too: every layer's backward is whole
    _, counted = count_flops(lambda: model(x).sum().backward())
    weights = sum(layer.weight.numel() for layer in layers)
    assert counted == 6 * weights * batch


def test_the_peak_table_knows_the_lent_gpus_and_no_cpu() -> None:
    assert device_peak_flops("NVIDIA H200") == 989.5e12
    assert device_peak_flops("NVIDIA H100 80GB HBM3", "fp32") == 494.7e12
    assert device_peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 on a V100
    assert device_peak_flops("cpu") is None
    meter = faccel.start_meter(faccel.detect({}), peak_flops=2e12)
    assert meter.spec.peak_flops == 2e12
    with pytest.raises(ArgumentValueError, match="peak_flops must be > 0"):
        faccel.start_meter(faccel.detect({}), peak_flops=0.0)


def test_the_phase_a_hang_record_would_say_follows_the_step() -> None:
    dist = faccel.detect({})
    model, optimizer = faccel.prepare(dist, torch.nn.Linear(2, 1), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    meter = faccel.start_meter(dist)
    seen = [dist.runtime.phase]
    faccel.backward(dist, model(torch.ones(1, 2)).sum())
    seen.append(dist.runtime.phase)
    faccel.clip_grad_norm(dist, model, 1.0)
    faccel.optimizer_step(dist, optimizer)
    seen.append(dist.runtime.phase)
    faccel.measure(dist, meter, items=1)
    seen.append(dist.runtime.phase)
    breadcrumb(dist, "checkpoint", step=1)  # what faccel.checkpoint notes first (a whole one costs seconds)
    seen.append(dist.runtime.phase)
    assert seen == ["setup", "backward", "optimizer", "forward", "checkpoint"]


def test_a_hang_record_reads_back_and_anything_else_in_its_place_reads_as_none(tmp_path: Path) -> None:
    record = HangRecord(
        rank=3, host="node-a", local_rank=1, call="gather", number=9, phase="backward", step=None,
        backwards=4, time=1.5, state="running",
    )  # fmt: skip
    write_record(tmp_path, record)
    assert read_record(tmp_path, 3) == record
    assert (
        "rank 3 (host node-a, local rank 1): in backward after gather() (its collective #9)"
        in record.describe()
    )
    assert read_record(tmp_path, 4) is None  # never written
    (tmp_path / "rank-00005.json").write_text('{"rank": "five"}')
    (tmp_path / "rank-00006.json").write_bytes(b"{" * (MAX_RECORD_BYTES + 1))
    os.mkfifo(tmp_path / "rank-00007.json")  # a FIFO is refused, never waited on
    assert [read_record(tmp_path, r) for r in (5, 6, 7)] == [None, None, None]
