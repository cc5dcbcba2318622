"""The waterfall PNG of ``kvpush ttft --png``: each request's TTFT as consecutive colored parts.

One row per request (the most recent ``last``, oldest at the top), x = ms since the request
arrived at the gateway, one segment per part in ``breakdown.PART_NAMES`` order with a fixed
palette and a legend, the TTFT written at the end of each row, and a last row "p50" made of the
median of each part over every request. Drawn with Pillow and its default font only.

Threading model: pure functions of their arguments. This module imports Pillow at import time,
so the CLI imports it only when ``--png`` is given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Final

from PIL import Image, ImageDraw, ImageFont

from kvpush.services.telemetry.breakdown import PART_NAMES, Breakdown
from kvpush.services.telemetry.ttft_report import PART_LABELS, percentile, short_id

# One color a part, PART_NAMES order (Tableau 10: distinct, print- and colorblind-tolerant).
PALETTE: Final = ("#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1")
INK: Final = "#222222"
MUTED: Final = "#666666"
GRID: Final = "#dcdcdc"
STRIPE: Final = "#f4f5f7"
DEFAULT_ROWS: Final = 40
DEFAULT_WIDTH: Final = 1200

_PAD = 24
ROW_HEIGHT: Final = 22
_BAR_H = 14

Font = ImageFont.FreeTypeFont | ImageFont.ImageFont


def _font(size: int) -> Font:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def nice_step(span: float, ticks: int = 10) -> float:
    """A 1/2/2.5/5 x 10^k step that cuts ``span`` into about ``ticks`` intervals."""
    raw = max(span, 1e-9) / ticks
    magnitude = 10 ** math.floor(math.log10(raw))
    return next(m * magnitude for m in (1, 2, 2.5, 5, 10) if raw <= m * magnitude * 1.0001)


def _ms(value: float) -> str:
    return f"{value:.6f}".rstrip("0").rstrip(".")


def render(
    breakdowns: Sequence[Breakdown], *, last: int = DEFAULT_ROWS, width: int = DEFAULT_WIDTH
) -> Image.Image:
    """The waterfall of the ``last`` most recent of ``breakdowns`` (p50 row: all of them)."""
    if not breakdowns:
        raise ValueError("no breakdowns to draw")
    everything = sorted(breakdowns, key=lambda b: b.start_ns)
    rows = everything[-last:] if last > 0 else everything
    medians = tuple(
        percentile([b.parts_ms[i] for b in everything], 50) for i in range(len(PART_NAMES))
    )
    ttfts = [b.ttft_ms for b in everything]
    labels = [f"{short_id(b)}  {b.mode}".rstrip() for b in rows] + ["p50 per part"]
    all_parts = [b.parts_ms for b in rows] + [medians]

    title_font, font, small = _font(18), _font(13), _font(12)
    label_w = max(font.getlength(t) for t in labels) + 14
    totals = [sum(parts) for parts in all_parts]
    value_w = max(font.getlength(f"{t:.1f} ms") for t in totals) + 16
    x0, x1 = _PAD + label_w, width - _PAD - value_w
    step = nice_step(max(totals))
    axis_max = max(step, math.ceil(max(totals) / step - 1e-9) * step)
    scale = (x1 - x0) / axis_max

    # Legend layout first: it may wrap, which moves everything below it.
    legend: list[tuple[float, int, int]] = []
    lx, ly = float(_PAD), _PAD + 52
    for i, label in enumerate(PART_LABELS):
        item_w = 16 + small.getlength(label) + 22
        if lx + item_w > width - _PAD and lx > _PAD:
            lx, ly = float(_PAD), ly + 20
        legend.append((lx, ly, i))
        lx += item_w
    top = ly + 36  # tick labels
    y_rows = top + 18
    y_sep = y_rows + len(rows) * ROW_HEIGHT + 4
    y_end = y_sep + 4 + ROW_HEIGHT
    height = int(y_end + 56 + _PAD)

    image = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(image)
    title = f"TTFT waterfall: {len(everything)} request{'s' if len(everything) != 1 else ''}"
    if len(rows) < len(everything):
        title += f" (rows: the last {len(rows)})"
    draw.text((_PAD, _PAD), title, font=title_font, fill=INK)
    draw.text(
        (_PAD, _PAD + 26),
        f"TTFT p50 {percentile(ttfts, 50):.1f} ms, p99 {percentile(ttfts, 99):.1f} ms"
        "  |  x: ms since the request arrived at the gateway  |  oldest at the top  |  "
        "last row: the median of each part",
        font=small,
        fill=MUTED,
    )
    for lx, ly, i in legend:
        draw.rectangle((lx, ly + 1, lx + 11, ly + 12), fill=PALETTE[i])
        draw.text((lx + 16, ly), PART_LABELS[i], font=small, fill=INK)

    for i in range(len(rows)):  # zebra stripes, then the grid over them
        if i % 2:
            y = y_rows + i * ROW_HEIGHT
            draw.rectangle((_PAD, y, width - _PAD, y + ROW_HEIGHT - 1), fill=STRIPE)
    tick = 0.0
    while tick <= axis_max + step / 1000:
        x = x0 + tick * scale
        draw.line((x, top + 14, x, y_end + 4), fill=GRID)
        for y, anchor in ((top + 12, "ms"), (y_end + 10, "mt")):
            draw.text((x, y), _ms(tick), font=small, fill=MUTED, anchor=anchor)
        tick += step
    draw.line((x0, y_end + 4, x0 + axis_max * scale, y_end + 4), fill=MUTED)
    draw.text(((x0 + x1) / 2, y_end + 30), "ms since arrival", font=small, fill=MUTED, anchor="mt")
    draw.line((_PAD, y_sep, width - _PAD, y_sep), fill=MUTED)

    for i, (label, parts, total) in enumerate(zip(labels, all_parts, totals, strict=True)):
        y = y_rows + i * ROW_HEIGHT + (8 if i == len(rows) else 0)
        middle = y + ROW_HEIGHT / 2
        draw.text((x0 - 10, middle), label, font=font, fill=INK, anchor="rm")
        left = 0.0
        for color, part in zip(PALETTE, parts, strict=True):
            a, b = x0 + left * scale, x0 + (left + part) * scale
            if b - a >= 0.5:
                draw.rectangle((a, middle - _BAR_H / 2, b, middle + _BAR_H / 2), fill=color)
            left += part
        draw.text(
            (x0 + total * scale + 6, middle), f"{total:.1f} ms", font=font, fill=INK, anchor="lm"
        )
    return image


def write_png(breakdowns: Sequence[Breakdown], path: str | Path) -> None:
    """Renders (see ``render``) and saves to ``path``."""
    render(breakdowns).save(path, format="PNG", optimize=True)
