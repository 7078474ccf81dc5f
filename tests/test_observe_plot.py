"""``python -m faccel plot`` draws the meter's curves beside the loss, as a PNG and as an HTML page.

Both are read back: the PNG's pixels and the page's SVG show one colour per curve, and the page,
opened in headless Chromium (Debian's ``chromium`` package; the test is skipped without it), shows
on its screenshot as many curve colours as the PNG.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from faccel.__main__ import main
from faccel._report._plot_panels import PALETTE

# The metrics a metered loop logs (Meter.metrics and Spread.metrics), beside its loss: 7 curves,
# 5 panels (the three step-time curves share the spread's panel).
CURVES = (
    "loss",
    "perf/items_per_second",
    "perf/mfu",
    "memory/peak_gib",
    "step_time/min",
    "step_time/median",
    "step_time/max",
)


def _run(folder: Path) -> Path:
    lines = []
    for step in range(40):
        spread = 0.1 + 0.01 * (step % 5)
        values = {
            "loss": 2.0 / (1 + step),
            "perf/items_per_second": 900.0 + 40 * (step % 7),
            "perf/mfu": 0.3 + 0.01 * (step % 3),
            "memory/peak_gib": 1.0 + 0.01 * step,
            "step_time/min": spread,
            "step_time/median": spread * 1.3,
            "step_time/max": spread * 2.1,
        }
        lines.append(json.dumps({"step": step, "time": step * 0.1, "source": "rank 0", "metrics": values}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _colours(image: Path) -> set[str]:
    """The palette colours the image shows, each on at least 20 pixels (anti-aliased edges aside)."""
    from PIL import Image

    pixels = np.asarray(Image.open(image).convert("RGB")).astype(np.int16)
    found = set()
    for colour in PALETTE:
        rgb = np.array([int(colour[i : i + 2], 16) for i in (1, 3, 5)], dtype=np.int16)
        if int((np.abs(pixels - rgb).max(axis=-1) <= 12).sum()) >= 20:
            found.add(colour)
    return found


@pytest.fixture(scope="module")
def drawn(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A run drawn once, by the command line's own entry point: its PNG and its HTML page."""
    run = _run(tmp_path_factory.mktemp("run"))
    assert main(["plot", str(run)]) == 0
    assert main(["plot", str(run), "--out", str(run / "metrics.html")]) == 0
    return run / "metrics.png", run / "metrics.html"


def test_the_png_and_the_html_page_show_the_same_curves(drawn: tuple[Path, Path]) -> None:
    png, html = drawn
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = html.read_text()
    strokes = re.findall(r'<polyline fill="none" stroke="(#[0-9a-f]{6})"', page)
    assert len(strokes) == len(CURVES) and len(set(strokes)) == len(CURVES)
    assert page.count("<svg") == 5 and "step time across ranks (s)" in page
    assert "<script" not in page and "http" not in page.replace("http://www.w3.org/2000/svg", "")
    # The image shows every curve's colour, and they are the page's.
    assert _colours(png) == set(strokes)


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(
    _chromium() is None,
    reason="headless Chromium is not installed (Debian: apt-get install -y chromium; .ci/run installs it)",
)
def test_the_html_page_renders_in_headless_chromium_with_the_pngs_curves(
    drawn: tuple[Path, Path], tmp_path: Path
) -> None:
    png, page = drawn
    shot = tmp_path / "shot.png"
    done = subprocess.run(
        [
            str(_chromium()),
            "--headless",
            "--no-sandbox",  # as root in a container; the page is our own file
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'profile'}",
            f"--screenshot={shot}",
            "--window-size=1500,1000",
            page.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    assert len(_colours(shot)) == len(_colours(png)) == len(CURVES)
