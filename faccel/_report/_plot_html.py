"""A run's curves as one self-contained HTML page: inline SVG, no script, nothing fetched.

The page shows the panels of :func:`faccel._report._plot_panels.panels`, the
same as the PNG, in the same colours: each curve a ``<polyline>`` (split where
a value is not finite), its panel's range written at the axes. A curve of more
than :data:`MAX_POINTS` points is thinned to every k-th point (its last kept),
so the page of a long run stays a few hundred KB; the PNG keeps every point.
"""

from __future__ import annotations

import html
import math
from collections.abc import Mapping, Sequence

from faccel._report._plot_panels import Panel, panels

__all__ = ["MAX_POINTS", "html_page"]

MAX_POINTS = 2000
_WIDTH, _HEIGHT, _MARGIN = 460, 280, 48


def _thin(points: Sequence[tuple[int, float]]) -> Sequence[tuple[int, float]]:
    if len(points) <= MAX_POINTS:
        return points
    stride = math.ceil(len(points) / MAX_POINTS)
    kept = list(points[::stride])
    if kept[-1] != points[-1]:
        kept.append(points[-1])
    return kept


def _svg(panel: Panel, curves: Mapping[str, Sequence[tuple[int, float]]]) -> str:
    points = {name: _thin(curves[name]) for name, _ in panel.series}
    steps = [s for pts in points.values() for s, _ in pts]
    values = [v for pts in points.values() for _, v in pts if math.isfinite(v)]
    x0, x1 = min(steps), max(steps)
    y0, y1 = (min(values), max(values)) if values else (0.0, 1.0)
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        y0, y1 = y0 - 1, y1 + 1
    inner_w, inner_h = _WIDTH - 2 * _MARGIN, _HEIGHT - 2 * _MARGIN

    def at(step: int, value: float) -> str:
        x = _MARGIN + (step - x0) / (x1 - x0) * inner_w
        y = _MARGIN + (1 - (value - y0) / (y1 - y0)) * inner_h
        return f"{x:.1f},{y:.1f}"

    lines = []
    for name, colour in panel.series:
        runs: list[list[str]] = [[]]
        for step, value in points[name]:
            if math.isfinite(value):
                runs[-1].append(at(step, value))
            elif runs[-1]:
                runs.append([])
        for run in runs:
            if len(run) == 1:  # a lone point: a dot, so it shows
                x, y = run[0].split(",")
                lines.append(f'<circle cx="{x}" cy="{y}" r="2.5" fill="{colour}"/>')
            elif run:
                lines.append(
                    f'<polyline fill="none" stroke="{colour}" stroke-width="2.5" points="{" ".join(run)}">'
                    f"<title>{html.escape(name)}</title></polyline>"
                )
    legend = "".join(
        f'<line x1="{_MARGIN + 4}" x2="{_MARGIN + 20}" y1="{_MARGIN + 10 + 14 * i}" '
        f'y2="{_MARGIN + 10 + 14 * i}" stroke="{colour}" stroke-width="2.5"/>'
        f'<text x="{_MARGIN + 24}" y="{_MARGIN + 14 + 14 * i}" font-size="11" fill="#333">'
        f"{html.escape(name)}</text>"
        for i, (name, colour) in enumerate(panel.series)
        if len(panel.series) > 1
    )
    b = _HEIGHT - _MARGIN
    return (
        f'<figure><svg xmlns="http://www.w3.org/2000/svg" width="{_WIDTH}" height="{_HEIGHT}" '
        f'viewBox="0 0 {_WIDTH} {_HEIGHT}" role="img" aria-label="{html.escape(panel.title)}">'
        f'<rect x="{_MARGIN}" y="{_MARGIN}" width="{inner_w}" height="{inner_h}" fill="none" stroke="#999"/>'
        f'<text x="{_WIDTH / 2}" y="20" text-anchor="middle" font-size="14">{html.escape(panel.title)}</text>'
        f'<text x="{_MARGIN - 4}" y="{_MARGIN + 4}" text-anchor="end" font-size="10">{y1:.4g}</text>'
        f'<text x="{_MARGIN - 4}" y="{b}" text-anchor="end" font-size="10">{y0:.4g}</text>'
        f'<text x="{_MARGIN}" y="{b + 14}" font-size="10">{x0}</text>'
        f'<text x="{_WIDTH - _MARGIN}" y="{b + 14}" text-anchor="end" font-size="10">{x1}</text>'
        f'<text x="{_WIDTH / 2}" y="{b + 30}" text-anchor="middle" font-size="11">step</text>'
        f"{''.join(lines)}{legend}</svg></figure>"
    )


def html_page(curves: Mapping[str, Sequence[tuple[int, float]]], *, title: str) -> str:
    """The page of ``curves`` (metric name -> ``(step, value)`` pairs, each non-empty).

    Example:
        >>> page = html_page({"loss": [(0, 1.0), (1, 0.5)]}, title="run")
        >>> page.startswith("<!DOCTYPE html>"), page.count("<polyline")
        (True, 1)
    """
    figures = "".join(_svg(panel, curves) for panel in panels(list(curves)))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>"
        "body{font-family:sans-serif;margin:16px;background:#fff}"
        "main{display:grid;grid-template-columns:repeat(3,470px);gap:8px}figure{margin:0}"
        f"</style></head><body><h1>{html.escape(title)}</h1><main>{figures}</main></body></html>\n"
    )
