"""Stragglers: every N steps the ranks' step times in one small collective, and the slow ones named.

:func:`check_stragglers` is called every step on every rank, like
:func:`faccel.measure`; on the steps that are a multiple of ``every`` it
gathers each rank's mean time a step over the window since the last check
(its forward time, before the gradient sync, where ``faccel.backward`` says
when that began: a slow rank makes the others wait inside the sync, so whole
step times come out equal) with its host and local rank, in one all_gather of
a few hundred bytes. The rule is :func:`slow_ranks`, a pure function: a rank
is slow when its time exceeds ``factor`` times the median, the lower median
(a time some rank took: with two ranks, the faster one's). The answer is a
:class:`Spread` on every rank, which the loop can log (its ``metrics()``, under
the trackers' standard names) or act on.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs

from faccel._dist._collectives import all_gather_bytes
from faccel._dist._hangs import here
from faccel._dist._process_group import comm_device, peers_answer, require_peers
from faccel._dist._state import DistState
from faccel._report._meter import Meter, restart_window
from faccel._report._tracking import SPREAD_NAMES
from faccel.errors import ArgumentValueError

__all__ = ["Spread", "Straggler", "check_stragglers", "slow_ranks"]

# The bytes a rank sends: {"seconds", "host", "local_rank"} as JSON (a host name is at most 253).
_PAYLOAD = 384


@attrs.frozen(kw_only=True)
class Straggler:
    """A rank slower than the median by more than the factor.

    Attributes:
        rank: Its global rank.
        host: Its host's name.
        local_rank: Its index on that host.
        seconds: Its mean time a step over the window.
        ratio: ``seconds`` over the median.

    Example:
        >>> Straggler(rank=1, host="node-a", local_rank=1, seconds=0.3, ratio=3.0).rank
        1
    """

    rank: int
    host: str
    local_rank: int
    seconds: float
    ratio: float


@attrs.frozen(kw_only=True)
class Spread:
    """The ranks' step times at one check, and the stragglers among them.

    Attributes:
        step: The meter's step at the check.
        seconds: Each rank's mean time a step over the window, in rank order.
        median: Their lower median.
        factor: The rule's factor.
        stragglers: The slow ranks, slowest first.

    Example:
        >>> spread = Spread(step=10, seconds=(0.1, 0.4), median=0.1, factor=2.0, stragglers=())
        >>> spread.metrics()["step_time/max"]
        0.4
    """

    step: int
    seconds: tuple[float, ...]
    median: float
    factor: float
    stragglers: tuple[Straggler, ...]

    def metrics(self) -> dict[str, float]:
        """Min, median and max of the ranks' times and the straggler count, under standard names."""
        values = {
            "min": min(self.seconds),
            "median": self.median,
            "max": max(self.seconds),
            "stragglers": float(len(self.stragglers)),
        }
        return {SPREAD_NAMES[key]: value for key, value in values.items()}

    def describe(self) -> str:
        """One line for a log: ``step 50: rank 1 (host a, local rank 1) 3.2x the median 0.012 s``."""
        if not self.stragglers:
            return f"step {self.step}: no straggler (median {self.median:.4g} s, factor {self.factor})"
        named = ", ".join(
            f"rank {s.rank} (host {s.host}, local rank {s.local_rank}) {s.ratio:.2f}x"
            for s in self.stragglers
        )
        return f"step {self.step}: {named} the median {self.median:.4g} s a step (factor {self.factor})"


def slow_ranks(seconds: Sequence[float], factor: float) -> tuple[int, ...]:
    """The ranks whose time exceeds ``factor`` times the lower median, slowest first.

    Args:
        seconds: Each rank's time, in rank order (at least one).
        factor: How much slower than the median counts as slow (> 1).

    Raises:
        ArgumentValueError: No times, or a factor that is not above 1.

    Example:
        >>> slow_ranks([0.10, 0.11, 0.35, 0.09], factor=2.0)
        (2,)
        >>> slow_ranks([0.1, 0.5], factor=2.0)        # the lower median: the faster rank's time
        (1,)
    """
    if not factor > 1:
        msg = f"the straggler factor must be > 1 (how many times the median is slow), got {factor}"
        raise ArgumentValueError(msg)
    if not seconds:
        msg = "slow_ranks needs every rank's time; got none"
        raise ArgumentValueError(msg)
    bar = factor * statistics.median_low(seconds)
    slow = [rank for rank, value in enumerate(seconds) if value > bar]
    return tuple(sorted(slow, key=lambda rank: (-seconds[rank], rank)))


def check_stragglers(
    dist: DistState, meter: Meter, *, every: int, factor: float = 1.5
) -> tuple[Spread | None, Meter]:
    """Every ``every`` steps, compare the ranks' step times; name the slow ones.

    Call it after :func:`faccel.measure`, every step, on every rank. On a step
    that is a multiple of ``every`` it is one small collective (every rank
    must be there); on the others it returns ``(None, meter)`` at once.

    Args:
        dist: The run's :class:`DistState`.
        meter: The meter after this step.
        every: Steps between checks (>= 1).
        factor: A rank slower than ``factor`` times the median is a straggler (> 1).

    Returns:
        ``(spread, meter)``: the :class:`Spread` on a check's step (else None),
        and the meter, its window emptied in place after a check.

    Raises:
        ArgumentValueError: ``every`` < 1 or ``factor`` <= 1.
        DistributedError: A rank did not reach the check in time; the error names
            it and what it was doing (docs/observe.md).

    Example:
        >>> import faccel
        >>> dist = faccel.detect({})
        >>> meter = faccel.measure(dist, faccel.start_meter(dist), items=8)
        >>> spread, meter = faccel.check_stragglers(dist, meter, every=1)
        >>> spread.seconds == (spread.median,), spread.stragglers, meter.window_steps
        (True, (), 0)
    """
    if every < 1:
        msg = f"check_stragglers: every must be >= 1 (steps between checks), got {every}"
        raise ArgumentValueError(msg)
    if not factor > 1:
        msg = f"check_stragglers: factor must be > 1 (how many times the median is slow), got {factor}"
        raise ArgumentValueError(msg)
    if meter.step % every or meter.window_steps == 0:
        return None, meter
    mine = meter.window_seconds / meter.window_steps
    require_peers(dist, "check_stragglers")
    reports: list[dict[str, Any]] = [{"seconds": mine, "host": here(), "local_rank": dist.local_rank}]
    if dist.distributed:
        payload = json.dumps(reports[0], separators=(",", ":")).encode()
        with peers_answer(dist, "check_stragglers"):
            raw = all_gather_bytes(payload, _PAYLOAD, comm_device(dist), dist.world_size)
        reports = [json.loads(r[4 : 4 + int.from_bytes(r[:4], "little")]) for r in raw]
    seconds = tuple(float(r["seconds"]) for r in reports)
    median = statistics.median_low(seconds)
    named = tuple(
        Straggler(
            rank=rank,
            host=str(reports[rank]["host"]),
            local_rank=int(reports[rank]["local_rank"]),
            seconds=seconds[rank],
            ratio=seconds[rank] / median if median > 0 else float("inf"),
        )
        for rank in slow_ranks(seconds, factor)
    )
    spread = Spread(step=meter.step, seconds=seconds, median=median, factor=factor, stragglers=named)
    # The window starts after the check: a rank that waited here for a slow one does not count it.
    return spread, restart_window(meter, time.perf_counter())
