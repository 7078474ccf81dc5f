"""Which metrics share a panel, and each curve's colour: one plan for the PNG and the HTML page.

``python -m faccel plot`` draws a run both as an image (matplotlib) and as a
self-contained HTML page (inline SVG); both follow :func:`panels`, so the two
show the same curves in the same colours. A metric has a panel of its own,
except the groups of :data:`SHARED_PANELS`: the ranks' step times at a
straggler check (``step_time/min``, ``/median``, ``/max``) are one panel, the
spread across ranks, drawn beside the loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs

__all__ = ["PALETTE", "SHARED_PANELS", "Panel", "panels"]

# Ten colours far from one another and from the greys of axes and grid; curve i gets PALETTE[i % 10].
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#bcbd22",
    "#17becf",
    "#3b3bff",
)
# Metric-name prefix -> the title of the one panel its metrics share.
SHARED_PANELS: Mapping[str, str] = {"step_time/": "step time across ranks (s)"}


@attrs.frozen(kw_only=True)
class Panel:
    """One panel: its title and its curves, each a metric's name with its colour.

    Example:
        >>> loss, spread = panels(["loss", "step_time/max", "step_time/min"])
        >>> loss.series, spread.title, [name for name, _ in spread.series]
        ((('loss', '#1f77b4'),), 'step time across ranks (s)', ['step_time/max', 'step_time/min'])
    """

    title: str
    series: tuple[tuple[str, str], ...]


def panels(names: Sequence[str]) -> list[Panel]:
    """The panels of a run's metrics ``names``, in name order, each curve with its colour."""
    grouped: dict[str, list[str]] = {}
    for name in sorted(names):
        title = next((t for prefix, t in SHARED_PANELS.items() if name.startswith(prefix)), name)
        grouped.setdefault(title, []).append(name)
    out, index = [], 0
    for title, members in grouped.items():
        series = []
        for name in members:
            series.append((name, PALETTE[index % len(PALETTE)]))
            index += 1
        out.append(Panel(title=title, series=tuple(series)))
    return out
