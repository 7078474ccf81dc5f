"""The meter: a step's throughput, time, memory and MFU, kept in a tally the loop holds.

A :class:`Meter` is the loop's own: it makes one with :func:`start_meter` and
passes it to :func:`measure` once a step, which reads the clock (and now and
then the memory) and adds the step to the meter in place. Nothing is counted
behind the loop's back: two meters coexist, a meter can be dropped and started
again, :meth:`Meter.copy` keeps a reading apart, and the laws of the rates are
tested on :func:`advance`, the pure form of the same step.

Memory is the rank's peak: CUDA's allocator (``max_memory_allocated``) on a
GPU, the process's peak resident set size on a CPU (the kernel's high-water
mark, ``getrusage``: 1.4 us, where reading ``/proc/self/statm`` costs 10 us a
step). Both are high-water marks, so reading them every :data:`MEMORY_SECONDS`
misses no peak: it shows at most that late (or a step late, for longer steps). MFU needs the
FLOPs of an item (``faccel.count_flops`` on the first step, or
``faccel.transformer_flops``) and the device's peak
(``faccel._report._flops.PEAK_FLOPS``, or ``peak_flops=``).
"""

from __future__ import annotations

import math
import resource
import sys
import time
from collections.abc import Callable, Mapping
from typing import Literal, NoReturn

import attrs
import torch

from faccel._dist._state import DistState
from faccel._report._flops import FlopSource, device_peak_flops
from faccel._report._tracking import METER_NAMES
from faccel.errors import ArgumentValueError

__all__ = [
    "MEMORY_SECONDS",
    "MemorySource",
    "Meter",
    "MeterSpec",
    "advance",
    "measure",
    "peak_memory",
    "restart_window",
    "start_meter",
]

MemorySource = Literal["cuda", "rss"]
# measure reads the peak memory on the first step and then once this many seconds have passed since
# its last read: a high-water mark read late misses no peak, and the read (a syscall, or CUDA's
# counters: 2 to 4 us inside a training loop) is paid once in so much time, not once in so many
# steps, so its share of a step stays under 0.01% however short the step.
MEMORY_SECONDS = 0.05
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


class Meter:
    """One rank's measures, kept by :func:`measure`: a live tally the loop holds, like an optimizer's state.

    :func:`start_meter` makes one; :func:`measure` adds each step to it *in
    place* and returns it (so ``meter = faccel.measure(dist, meter, items=n)``
    reads as an update). A step costs a few attribute stores, no new object: a
    frozen record a step cost 4 to 7 us inside a small model's loop, over 1% of
    its step (docs/observe.md). The measures read as attributes below;
    :meth:`copy` keeps a reading that later steps leave alone, and :func:`advance`
    is the pure form (a new meter from the old), the laws' subject. What never
    changes (the start, the FLOPs, the peak) sits in ``spec``.

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

    # Private slots behind read-only properties: only measure, advance and check_stragglers move
    # them, and a store to a slot is the cheapest write Python has.
    __slots__ = (
        "_forward_seconds",
        "_items",
        "_last",
        "_memory_at",
        "_memory_bytes",
        "_spec",
        "_step",
        "_step_items",
        "_step_seconds",
        "_window_seconds",
        "_window_steps",
    )

    def __init__(self, *, spec: MeterSpec, last: float) -> None:
        self._spec = spec
        self._last = last
        self._step = 0
        self._items = 0
        self._step_items = 0
        self._step_seconds = 0.0
        self._forward_seconds: float | None = None
        self._window_seconds = 0.0
        self._window_steps = 0
        self._memory_bytes: int | None = None
        self._memory_at = -math.inf  # when measure last read the memory: never

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

    def copy(self) -> Meter:
        """This meter as it reads now, apart: measuring this one later leaves the copy as it is.

        Example:
            >>> m = Meter.create(started=0.0)
            >>> before = m.copy()
            >>> _add(m, 4, 1.0, None, None).step, before.step
            (1, 0)
        """
        new = Meter(spec=self._spec, last=self._last)
        for name in Meter.__slots__:
            setattr(new, name, getattr(self, name))
        return new

    def __repr__(self) -> str:
        return (
            f"Meter(step={self._step}, items={self._items}, step_seconds={self._step_seconds!r}, "
            f"forward_seconds={self._forward_seconds!r}, memory_bytes={self._memory_bytes!r}, "
            f"spec={self._spec!r})"
        )

    @property
    def spec(self) -> MeterSpec:
        """What the meter knows from its start: clock start, FLOPs per item, device peak, memory source."""
        return self._spec

    @property
    def last(self) -> float:
        """When the last step ended (``time.perf_counter``), or the start."""
        return self._last

    @property
    def step(self) -> int:
        """Steps measured."""
        return self._step

    @property
    def items(self) -> int:
        """Items (samples, tokens) over the run, this rank's."""
        return self._items

    @property
    def step_items(self) -> int:
        """The last step's items."""
        return self._step_items

    @property
    def step_seconds(self) -> float:
        """The last step's time, from the measure before it to its own."""
        return self._step_seconds

    @property
    def forward_seconds(self) -> float | None:
        """The part of the last step before its last ``faccel.backward``, or None without one."""
        return self._forward_seconds

    @property
    def window_seconds(self) -> float:
        """Time summed since the last straggler check (forward time where known, else step time)."""
        return self._window_seconds

    @property
    def window_steps(self) -> int:
        """Steps since the last straggler check."""
        return self._window_steps

    @property
    def memory_bytes(self) -> int | None:
        """Peak memory so far, as last read (see :func:`measure`), or None before it is read."""
        return self._memory_bytes

    @property
    def items_per_second(self) -> float:
        """The last step's items per second on this rank (0 before any step)."""
        return _rate(self._step_items, self._step_seconds)

    @property
    def run_items_per_second(self) -> float:
        """Items per second on this rank over the whole run so far."""
        return _rate(self._items, self._last - self._spec.started)

    @property
    def flops_per_second(self) -> float | None:
        """The model's FLOP/s on this rank in the last step, or None without ``flops_per_item``."""
        flops = self._spec.flops_per_item
        return None if flops is None else flops * self.items_per_second

    @property
    def mfu(self) -> float | None:
        """Model FLOPs utilisation of the last step (0 to 1), or None without FLOPs or a peak."""
        flops = self.flops_per_second
        peak = self._spec.peak_flops
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
        memory = self._memory_bytes
        flops = self.flops_per_second
        values: dict[str, float | None] = {
            "items_per_second": self.items_per_second,
            "run_items_per_second": self.run_items_per_second,
            "step_seconds": self._step_seconds,
            "forward_seconds": self._forward_seconds,
            "tflops": None if flops is None else flops / 1e12,
            "mfu": self.mfu,
            "peak_memory_gib": None if memory is None else memory / (1 << 30),
        }
        return {METER_NAMES[key]: value for key, value in values.items() if value is not None}


def _rate(items: int, seconds: float) -> float:
    if items == 0:
        return 0.0
    return items / seconds if seconds > 0 else math.inf


def _refuse(items: int, now: float, last: float) -> NoReturn:
    msg = (
        f"measure: a step has items >= 0 and ends after the last one; got items={items}, "
        f"now={now} against the last end {last}: pass the step's item count and a "
        "monotonic clock (time.perf_counter)"
    )
    raise ArgumentValueError(msg)


def _keep_peak(meter: Meter, memory: int) -> None:
    peak = meter._memory_bytes
    if peak is None or memory > peak:
        meter._memory_bytes = memory


def _add(meter: Meter, items: int, now: float, memory: int | None, backward_at: float | None) -> Meter:
    # One step added to ``meter`` in place: advance's path, on its copy. measure writes the same
    # stores out in its own body (tests/test_observe.py checks the two agree).
    last = meter._last
    seconds = now - last
    if items < 0 or seconds < 0:
        _refuse(items, now, last)
    forward = None
    if backward_at is not None and last <= backward_at <= now:
        forward = backward_at - last
    if memory is not None:
        _keep_peak(meter, memory)
    meter._last = now
    meter._step += 1
    meter._items += items
    meter._step_items = items
    meter._step_seconds = seconds
    meter._forward_seconds = forward
    meter._window_seconds += seconds if forward is None else forward
    meter._window_steps += 1
    return meter


def restart_window(meter: Meter, now: float) -> Meter:
    """Empty ``meter``'s straggler window and restart its step clock at ``now``, in place; the meter.

    What :func:`faccel.check_stragglers` does after a check: the time a rank
    waited there for a slow one counts in no step.

    Example:
        >>> m = restart_window(advance(Meter.create(started=0.0), items=1, now=1.0), 1.5)
        >>> m.window_steps, m.window_seconds, m.last, m.step
        (0, 0.0, 1.5, 1)
    """
    meter._window_seconds = 0.0
    meter._window_steps = 0
    meter._last = now
    return meter


def advance(
    meter: Meter, *, items: int, now: float, memory: int | None = None, backward_at: float | None = None
) -> Meter:
    """A new meter: ``meter`` after one more step of ``items`` that ended at ``now`` (``meter`` unchanged).

    The pure form of :func:`measure`'s step (the same arithmetic, on a copy):
    the laws of the rates are tested on it.

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
    return _add(meter.copy(), items, now, memory, backward_at)


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
    """Add this step to ``meter``, in place, and return it: call it at the end of every step, on every rank.

    Reads the clock, when the step's last ``faccel.backward`` began, and the
    peak memory on the first step and then every :data:`MEMORY_SECONDS` (a
    high-water mark: no peak is missed; it shows at most that late, or one step
    late when steps are longer). The step is a few stores into the meter, no new object: its price
    inside the seed's small MLP is in docs/observe.md. No collective: per-rank
    only (:func:`faccel.check_stragglers` compares the ranks every N steps).
    The next step's phase, for a hang record, is ``forward``.

    Args:
        dist: The run's :class:`DistState`.
        meter: The meter of this loop (:func:`start_meter`'s), changed in place.
        items: The step's items on this rank (samples, or tokens).

    Returns:
        ``meter``, with this step added (``meter = faccel.measure(...)`` reads as the update it is).

    Raises:
        ArgumentValueError: Negative ``items``, or a clock that went back.

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
    if now - meter._memory_at >= MEMORY_SECONDS:
        meter._memory_at = now
        spec = meter._spec
        _keep_peak(meter, _MEMORY[spec.memory_source](spec.device))
    # _add's step written out here: the call to it was a quarter of measure's price inside a
    # small model's loop (0.4 of 1.7 us), where a cold call costs more than it does alone.
    last = meter._last
    seconds = now - last
    if items < 0 or seconds < 0:
        _refuse(items, now, last)
    backward_at = runtime.backward_at
    forward = backward_at - last if last <= backward_at <= now else None
    meter._last = now
    meter._step += 1
    meter._items += items
    meter._step_items = items
    meter._step_seconds = seconds
    meter._forward_seconds = forward
    meter._window_seconds += seconds if forward is None else forward
    meter._window_steps += 1
    return meter
