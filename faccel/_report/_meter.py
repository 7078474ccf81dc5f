"""The meter: a step's throughput, time, memory and MFU, as a value the loop holds.

A :class:`Meter` is a frozen record, like ``TrainState``: the loop makes one
with :func:`start_meter` and replaces it every step with :func:`measure`,
which reads the clock and the memory and hands them to :func:`advance`, the
pure function that makes the next record from the previous one. Nothing is
counted behind the loop's back: two meters coexist, a meter can be dropped and
started again, and the laws of the rates are tested on :func:`advance` alone.

Memory is the rank's peak: CUDA's allocator (``max_memory_allocated``) on a
GPU, the process's peak resident set size on a CPU (the kernel's high-water
mark, ``getrusage``: 1.4 us, where reading ``/proc/self/statm`` costs 10 us a
step). MFU needs the FLOPs of an item (``faccel.count_flops`` on the first
step, or ``faccel.transformer_flops``) and the device's peak
(``faccel._report._flops.PEAK_FLOPS``, or ``peak_flops=``).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import Literal

import attrs
import torch

from faccel._dist._state import DistState
from faccel._report._flops import FlopSource, device_peak_flops
from faccel._report._tracking import METER_NAMES
from faccel.errors import ArgumentValueError

__all__ = [
    "MEMORY_EVERY",
    "MemorySource",
    "Meter",
    "MeterSpec",
    "advance",
    "measure",
    "peak_memory",
    "start_meter",
]

MemorySource = Literal["cuda", "rss"]
# measure reads the peak memory on the first step and every MEMORY_EVERY steps: a peak moves little
# once training runs, and its read (a syscall, or CUDA's counters) is a third of measure's cost.
MEMORY_EVERY = 16
# ru_maxrss is in kilobytes on Linux, in bytes on macOS.
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024


def _rss_peak(device: str) -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT


def _cuda_peak(device: str) -> int:
    return int(torch.cuda.max_memory_allocated(device))


# How each source reads the peak, chosen once by start_meter from the device's type.
_MEMORY: Mapping[str, Callable[[str], int]] = {"cuda": _cuda_peak, "rss": _rss_peak}


def peak_memory(source: MemorySource, device: torch.device | str = "cpu") -> int:
    """This process's peak memory in bytes: CUDA's allocator peak on ``device``, or the peak RSS.

    Example:
        >>> peak_memory("rss") > 0
        True
    """
    return _MEMORY[source](str(device))


@attrs.frozen(kw_only=True)
class MeterSpec:
    """What a meter knows from its start and never changes: its clock's start, FLOPs, peak, memory source.

    Attributes:
        started: When the meter started (``time.perf_counter``).
        memory_source: ``"cuda"`` (the allocator's peak) or ``"rss"`` (peak resident set).
        flops_per_item: FLOPs of one item's forward and backward, or None (no MFU).
        flops_source: How ``flops_per_item`` was found: ``"counted"``
            (``FlopCounterMode``), ``"formula"`` (6N + attention) or ``"given"``.
        peak_flops: The device's peak FLOP/s, or None (no MFU).
        device: Where memory is read.

    Example:
        >>> MeterSpec(started=0.0).memory_source
        'rss'
    """

    started: float
    memory_source: MemorySource = "rss"
    flops_per_item: float | None = None
    flops_source: FlopSource = "given"
    peak_flops: float | None = None
    device: str = "cpu"


@attrs.frozen(kw_only=True)
class Meter:
    """One rank's measures after its last step; made by :func:`start_meter`, advanced by :func:`measure`.

    The fields are what changes each step; what does not (the start, the FLOPs,
    the peak) sits in ``spec``, so each step makes a small record.

    Attributes:
        spec: The :class:`MeterSpec`: start time, FLOPs per item, device peak, memory source.
        last: When the last step ended (the last :func:`measure`), or the start.
        step: Steps measured.
        items: Items (samples, tokens) over the run, this rank's.
        step_items: The last step's items.
        step_seconds: The last step's time, from the measure before it to its own.
        forward_seconds: The part of the last step before its last ``faccel.backward``
            (data, forward, loss): the rank's own work, in which no gradient sync
            waits (DDP's). None when the step called no ``faccel.backward``.
        window_seconds: Time summed since the last straggler check (forward time
            where known, else step time); :func:`faccel.check_stragglers` gathers it.
        window_steps: Steps in that window.
        memory_bytes: Peak memory so far (``spec.memory_source``), or None before it is read.

    Example:
        >>> m = Meter.create(started=0.0, peak_flops=1e9, flops_per_item=1e6)
        >>> m = advance(m, items=32, now=0.5, memory=1 << 20)
        >>> m.items_per_second, m.mfu
        (64.0, 0.064)
    """

    spec: MeterSpec
    last: float
    step: int = 0
    items: int = 0
    step_items: int = 0
    step_seconds: float = 0.0
    forward_seconds: float | None = None
    window_seconds: float = 0.0
    window_steps: int = 0
    memory_bytes: int | None = None

    @classmethod
    def create(
        cls,
        *,
        started: float,
        memory_source: MemorySource = "rss",
        flops_per_item: float | None = None,
        flops_source: FlopSource = "given",
        peak_flops: float | None = None,
        device: str = "cpu",
    ) -> Meter:
        """A meter at step 0 that started at ``started``, with its :class:`MeterSpec` from the keywords.

        Example:
            >>> Meter.create(started=1.0).last
            1.0
        """
        spec = MeterSpec(
            started=started,
            memory_source=memory_source,
            flops_per_item=flops_per_item,
            flops_source=flops_source,
            peak_flops=peak_flops,
            device=device,
        )
        return cls(spec=spec, last=started)

    @property
    def items_per_second(self) -> float:
        """The last step's items per second on this rank (0 before any step)."""
        return _rate(self.step_items, self.step_seconds)

    @property
    def run_items_per_second(self) -> float:
        """Items per second on this rank over the whole run so far."""
        return _rate(self.items, self.last - self.spec.started)

    @property
    def flops_per_second(self) -> float | None:
        """The model's FLOP/s on this rank in the last step, or None without ``flops_per_item``."""
        flops = self.spec.flops_per_item
        return None if flops is None else flops * self.items_per_second

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation of the last step (0 to 1), or None without FLOPs or a peak."""
        flops = self.flops_per_second
        peak = self.spec.peak_flops
        if flops is None or not peak:
            return None
        return flops / peak

    def eta(self, remaining_items: int) -> float:
        """Seconds left for ``remaining_items`` at the run's rate so far (inf before any item).

        Example:
            >>> advance(Meter.create(started=0.0), items=10, now=2.0).eta(50)
            10.0
        """
        rate = self.run_items_per_second
        return remaining_items / rate if rate > 0 else math.inf

    def metrics(self) -> dict[str, float]:
        """The measures under the trackers' standard names (``faccel._report._tracking.METER_NAMES``).

        A measure that is not known (MFU without FLOPs, forward time without a
        ``faccel.backward``) is left out, not logged as zero.

        Example:
            >>> sorted(advance(Meter.create(started=0.0), items=4, now=1.0, memory=8).metrics())
            ['memory/peak_gib', 'perf/items_per_second', 'perf/items_per_second_run', 'perf/step_seconds']
        """
        values: dict[str, float | None] = {
            "items_per_second": self.items_per_second,
            "run_items_per_second": self.run_items_per_second,
            "step_seconds": self.step_seconds,
            "forward_seconds": self.forward_seconds,
            "tflops": None if self.flops_per_second is None else self.flops_per_second / 1e12,
            "mfu": self.mfu,
            "peak_memory_gib": None if self.memory_bytes is None else self.memory_bytes / (1 << 30),
        }
        return {METER_NAMES[key]: value for key, value in values.items() if value is not None}


def _rate(items: int, seconds: float) -> float:
    if items == 0:
        return 0.0
    return items / seconds if seconds > 0 else math.inf


def advance(
    meter: Meter, *, items: int, now: float, memory: int | None = None, backward_at: float | None = None
) -> Meter:
    """The meter after one more step of ``items`` that ended at ``now``: pure, the laws' subject.

    Args:
        meter: The meter before the step.
        items: The step's items on this rank (samples, or tokens).
        now: When the step ended, on the meter's clock (``time.perf_counter``).
        memory: The peak memory now, in bytes (kept as the maximum seen).
        backward_at: When the step's last backward began; its forward time is
            ``backward_at - meter.last`` when it lies inside the step.

    Returns:
        The new :class:`Meter`.

    Raises:
        ArgumentValueError: Negative ``items``, or ``now`` before the last step's end.

    Example:
        >>> m = advance(Meter.create(started=0.0), items=8, now=0.25, backward_at=0.2)
        >>> m.step, m.items_per_second, m.forward_seconds
        (1, 32.0, 0.2)
    """
    seconds = now - meter.last
    if items < 0 or seconds < 0:
        msg = (
            f"measure: a step has items >= 0 and ends after the last one; got items={items}, "
            f"now={now} against the last end {meter.last}: pass the step's item count and a "
            "monotonic clock (time.perf_counter)"
        )
        raise ArgumentValueError(msg)
    forward = None
    if backward_at is not None and meter.last <= backward_at <= now:
        forward = backward_at - meter.last
    peak = meter.memory_bytes
    if memory is not None and (peak is None or memory > peak):
        peak = memory
    # Made whole, not with attrs.evolve: evolve reads every field back first, which in a loop
    # of a small model cost as much again as the record (benchmarks/bench_observe.py).
    return Meter(
        spec=meter.spec,
        last=now,
        step=meter.step + 1,
        items=meter.items + items,
        step_items=items,
        step_seconds=seconds,
        forward_seconds=forward,
        window_seconds=meter.window_seconds + (seconds if forward is None else forward),
        window_steps=meter.window_steps + 1,
        memory_bytes=peak,
    )


def start_meter(
    dist: DistState,
    *,
    flops_per_item: float | None = None,
    flops_source: FlopSource = "given",
    peak_flops: float | None = None,
) -> Meter:
    """A meter for this rank, starting now: pass it to :func:`measure` once a step.

    Args:
        dist: The run's :class:`DistState` (its device says where memory is read).
        flops_per_item: FLOPs of one item's forward and backward, for MFU:
            ``faccel.count_flops`` over the first step divided by its items
            (``flops_source="counted"``), or ``faccel.transformer_flops``
            (``"formula"``).
        flops_source: Where ``flops_per_item`` came from: ``"counted"``,
            ``"formula"`` or ``"given"``; the docs of a run should say it.
        peak_flops: The device's peak FLOP/s; by default the table's figure for
            this CUDA device at the run's precision (fp32 without one), None elsewhere.

    Returns:
        A :class:`Meter` at step 0.

    Raises:
        ArgumentValueError: A negative ``flops_per_item`` or a ``peak_flops`` that is not positive.

    Example:
        >>> import faccel
        >>> meter = faccel.start_meter(faccel.detect({}), flops_per_item=1e6, peak_flops=1e12)
        >>> meter.step, meter.spec.memory_source
        (0, 'rss')
    """
    if flops_per_item is not None and not flops_per_item >= 0:
        msg = f"start_meter: flops_per_item must be >= 0, got {flops_per_item}"
        raise ArgumentValueError(msg)
    if peak_flops is not None and not peak_flops > 0:
        msg = f"start_meter: peak_flops must be > 0 (FLOP/s), got {peak_flops}"
        raise ArgumentValueError(msg)
    device = torch.device(dist.device)
    source: MemorySource = "cuda" if device.type == "cuda" else "rss"
    if peak_flops is None and device.type == "cuda":
        precision = dist.precision if dist.precision in ("bf16", "fp16") else "fp32"
        peak_flops = device_peak_flops(torch.cuda.get_device_name(device), precision)  # type: ignore[arg-type]
    return Meter.create(
        started=time.perf_counter(),
        memory_source=source,
        flops_per_item=flops_per_item,
        flops_source=flops_source,
        peak_flops=peak_flops,
        device=str(device),
    )


def measure(dist: DistState, meter: Meter, *, items: int) -> Meter:
    """The meter after this step: call it once at the end of every step, on every rank.

    Reads the clock, the peak memory (on the first step and every
    :data:`MEMORY_EVERY` steps after) and when the step's last
    ``faccel.backward`` began, and returns :func:`advance`'s new record. No
    collective: per-rank only (:func:`faccel.check_stragglers` compares the
    ranks every N steps). The next step's phase, for a hang record, is
    ``forward``.

    Args:
        dist: The run's :class:`DistState`.
        meter: The meter after the previous step (or :func:`start_meter`'s).
        items: The step's items on this rank (samples, or tokens).

    Returns:
        The new :class:`Meter`.

    Example:
        >>> import faccel
        >>> dist = faccel.detect({})
        >>> meter = faccel.measure(dist, faccel.start_meter(dist), items=32)
        >>> meter.step, meter.items, meter.memory_bytes > 0
        (1, 32, True)
    """
    runtime = dist.runtime
    runtime.phase = "forward"
    now = time.perf_counter()
    spec = meter.spec
    memory = None if meter.step % MEMORY_EVERY else _MEMORY[spec.memory_source](spec.device)
    return advance(meter, items=items, now=now, memory=memory, backward_at=runtime.backward_at)
