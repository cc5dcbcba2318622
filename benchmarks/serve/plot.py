"""Line charts of ``kvpush bench serve`` with Pillow: TTFT P50 and P99 against QPS per system.

One PNG per (dataset, input length): two panels side by side, one line per system, a legend,
axis ticks. No matplotlib dependency.

Threading model: pure functions.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

COLORS = {
    "kvpush-push": (214, 39, 40),
    "kvpush-pull": (255, 127, 14),
    "vllm-pull": (31, 119, 180),
    "vllm-push": (44, 160, 44),
    "aggregated": (127, 127, 127),
}
FALLBACK = [(148, 103, 189), (140, 86, 75), (227, 119, 194), (23, 190, 207)]
PANEL_W, PANEL_H, MARGIN = 560, 380, 64


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


LOG_SPAN = 20  # a panel whose values span more than this factor gets a log y axis


def _nice_ticks(top: float, count: int = 5) -> list[float]:
    if top <= 0:
        return [0.0, 1.0]
    raw = top / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = min((m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw), default=raw)
    return [i * step for i in range(int(top / step) + 2)]


def _log_ticks(low: float, high: float) -> list[float]:
    """1-2-5 ticks of each decade from below ``low`` to above ``high``."""
    ticks = []
    for decade in range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1):
        ticks += [m * 10.0**decade for m in (1, 2, 5)]
    first = max(t for t in ticks if t <= low)
    last = min(t for t in ticks if t >= high)
    return [t for t in ticks if first <= t <= last]


def _panel(
    draw: ImageDraw.ImageDraw,
    origin: tuple[int, int],
    title: str,
    series: dict[str, list[tuple[float, float]]],
) -> None:
    x0, y0 = origin
    left, top = x0 + MARGIN, y0 + 36
    width, height = PANEL_W - MARGIN - 16, PANEL_H - 36 - 48
    font, small = _font(15), _font(12)
    draw.text((x0 + MARGIN, y0 + 8), title, fill=(20, 20, 20), font=font)
    points = [p for line in series.values() for p in line]
    if not points:
        draw.text((left + 10, top + 10), "no data", fill=(120, 120, 120), font=small)
        return
    x_ticks = _nice_ticks(max(x for x, _ in points) * 1.05)
    x_max = x_ticks[-1]
    positive = [y for _, y in points if y > 0]
    log = bool(positive) and max(positive) > LOG_SPAN * min(positive)  # else one line hides all
    if log:
        y_ticks = _log_ticks(min(positive), max(positive))
        low, high = math.log10(y_ticks[0]), math.log10(y_ticks[-1])
        draw.text((x0 + MARGIN + 150, y0 + 10), "log scale", fill=(120, 120, 120), font=small)
    else:
        y_ticks = _nice_ticks(max(y for _, y in points) * 1.08)
    y_max = y_ticks[-1]

    def at(x: float, y: float) -> tuple[float, float]:
        if log:
            share = (math.log10(max(y, y_ticks[0])) - low) / (high - low)
            return left + width * x / x_max, top + height * (1 - share)
        return left + width * x / x_max, top + height * (1 - y / y_max)

    for y in y_ticks:
        _, py = at(0, y)
        draw.line([(left, py), (left + width, py)], fill=(232, 232, 232))
        draw.text((left - 8, py), f"{y:g}", fill=(90, 90, 90), font=small, anchor="rm")
    for x in x_ticks:
        px, _ = at(x, 0)
        draw.line([(px, top + height), (px, top + height + 4)], fill=(90, 90, 90))
        draw.text((px, top + height + 8), f"{x:g}", fill=(90, 90, 90), font=small, anchor="mt")
    draw.rectangle([left, top, left + width, top + height], outline=(120, 120, 120))
    draw.text((left + width / 2, top + height + 26), "QPS", fill=(60, 60, 60), font=small)
    draw.text((x0 + 8, top - 22), "ms", fill=(60, 60, 60), font=small)
    for i, (name, line) in enumerate(series.items()):
        color = COLORS.get(name, FALLBACK[i % len(FALLBACK)])
        xy = [at(x, y) for x, y in sorted(line)]
        if len(xy) > 1:
            draw.line(xy, fill=color, width=3)
        for px, py in xy:
            draw.ellipse([px - 4, py - 4, px + 4, py + 4], fill=color)


def ttft_chart(
    path: Path, title: str, p50: dict[str, list[tuple[float, float]]], p99: dict[str, list]
) -> Path:
    """Write the two-panel chart; ``p50``/``p99``: system -> [(qps, ms), ...]."""
    names = list(dict.fromkeys([*p50, *p99]))
    legend_h = 34
    image = Image.new("RGB", (2 * PANEL_W, PANEL_H + 40 + legend_h), "white")
    draw = ImageDraw.Draw(image)
    draw.text((16, 10), title, fill=(10, 10, 10), font=_font(18))
    _panel(draw, (0, 40), "TTFT P50 (ms)", p50)
    _panel(draw, (PANEL_W, 40), "TTFT P99 (ms)", p99)
    x, y = MARGIN, PANEL_H + 40 + 6
    for i, name in enumerate(names):
        color = COLORS.get(name, FALLBACK[i % len(FALLBACK)])
        draw.rectangle([x, y + 4, x + 18, y + 16], fill=color)
        draw.text((x + 24, y + 2), name, fill=(30, 30, 30), font=_font(14))
        x += 40 + int(draw.textlength(name, font=_font(14)))
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path
