"""Server-rendered SVG charts for the admin's usage page: no script, no stylesheet from elsewhere,
so the admin works offline.

    chart("Requests", ["14:00", "15:00"], [Series("requests", BLUE, [3, 5])], kind="bars")

A chart scales to its container's width (`viewBox`, width 100%). Every value is an element of
class `point` carrying `data-series` and `data-value`, with a `<title>` the browser shows on
hover. Text and grid lines take the page's text colour, so the admin's dark theme reads too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe

# At about its own size in each of the page's two columns at 1440 px (11-unit text stays ~11 px).
WIDTH = 480
HEIGHT = 200
LEFT, RIGHT, TOP, BOTTOM = 44, 8, 28, 26
MAX_X_LABELS = 8

BLUE = "#417690"  # the admin's own header blue
RED = "#ba2121"  # the admin's error red
GREEN = "#5b9a2b"
ORANGE = "#d08a1e"
TEAL = "#3f9fb5"


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    color: str
    values: list[float]
    unit: str = ""


def chart(
    title: str,
    labels: list[str],
    series: list[Series],
    *,
    kind: Literal["bars", "overlaid bars", "lines"],
    hover_labels: list[str] | None = None,
) -> SafeString:
    """An SVG chart of `series` over the buckets named by `labels` (x axis, a few shown).

    "bars" puts the series' bars side by side in each bucket; "overlaid bars" draws each over the
    one before, from the same baseline (a part of a whole: errors over requests); "lines" joins
    each series' points. `hover_labels` name the buckets in the points' titles (default: labels).
    """
    n = len(labels)
    hover = hover_labels or labels
    top, ticks = scale(max((v for s in series for v in s.values), default=0.0))
    plot_w = WIDTH - LEFT - RIGHT
    plot_h = HEIGHT - TOP - BOTTOM
    band = plot_w / max(n, 1)

    def y(value: float) -> float:
        return TOP + plot_h - (value / top) * plot_h

    parts: list[str] = []
    # Grid and y axis labels.
    for i in range(ticks + 1):
        value = top * i / ticks
        parts.append(format_html(
            '<line x1="{}" x2="{}" y1="{}" y2="{}" stroke="currentColor" stroke-opacity="{}"/>'
            '<text x="{}" y="{}" text-anchor="end" dominant-baseline="middle">{}</text>',
            LEFT, WIDTH - RIGHT, _n(y(value)), _n(y(value)), "0.35" if i == 0 else "0.12",
            LEFT - 6, _n(y(value)), compact(value),
        ))  # fmt: skip
    # X axis labels: a few, always the last (the current bucket).
    step = max(1, math.ceil(n / MAX_X_LABELS))
    for i, label in enumerate(labels):
        if (n - 1 - i) % step == 0:
            parts.append(format_html(
                '<text x="{}" y="{}" text-anchor="middle">{}</text>', _n(LEFT + band * (i + 0.5)), HEIGHT - BOTTOM + 15, label
            ))  # fmt: skip
    # The data.
    if kind == "lines":
        for s in series:
            points = [(LEFT + band * (i + 0.5), y(v)) for i, v in enumerate(s.values)]
            parts.append(format_html(
                '<polyline fill="none" stroke="{}" stroke-width="2" stroke-linejoin="round" points="{}"/>',
                s.color, " ".join(f"{_n(px)},{_n(py)}" for px, py in points),
            ))  # fmt: skip
            for (px, py), v, name in zip(points, s.values, hover, strict=True):
                parts.append(format_html(
                    '<circle class="point" data-series="{}" data-value="{}" cx="{}" cy="{}" r="2.6" fill="{}">'
                    "<title>{} · {}: {}</title></circle>",
                    s.name, _value(v), _n(px), _n(py), s.color, name, s.name, _described(v, s.unit),
                ))  # fmt: skip
    else:
        side_by_side = kind == "bars"
        width = band * 0.76 / (len(series) if side_by_side else 1)
        for k, s in enumerate(series):
            for i, (v, name) in enumerate(zip(s.values, hover, strict=True)):
                x = LEFT + band * i + band * 0.12 + (k * width if side_by_side else 0.0)
                parts.append(format_html(
                    '<rect class="point" data-series="{}" data-value="{}" x="{}" y="{}" width="{}" height="{}" fill="{}">'
                    "<title>{} · {}: {}</title></rect>",
                    s.name, _value(v), _n(x), _n(y(v)), _n(width), _n(y(0) - y(v)), s.color, name, s.name, _described(v, s.unit),
                ))  # fmt: skip
    # Legend, above the plot.
    x = LEFT
    for s in series:
        parts.append(format_html(
            '<rect x="{}" y="8" width="10" height="10" fill="{}"/><text x="{}" y="13" dominant-baseline="middle">{}</text>',
            x, s.color, x + 14, s.name,
        ))  # fmt: skip
        x += 14 + 7 * len(s.name) + 18
    body = mark_safe("".join(parts))  # every part above went through format_html
    return format_html(
        '<svg class="usage-chart" viewBox="0 0 {} {}" role="img" aria-label="{}" font-size="11" fill="currentColor" '
        'font-family="inherit" preserveAspectRatio="xMidYMid meet"><title>{}</title>{}</svg>',
        WIDTH, HEIGHT, title, title, body,
    )


def nice_ceiling(value: float) -> float:
    """The least of 1, 2, 2.5, 5 times a power of ten that is at least `value` (1 for nothing)."""
    return scale(value)[0]


def scale(value: float) -> tuple[float, int]:
    """The y axis's top for a largest value, and how many equal steps divide it into round ticks
    (50: 0, 10 … 50; 20: 0, 5 … 20; 25: 0, 5 … 25)."""
    if value <= 0:
        return 1.0, 1
    power = 10.0 ** math.floor(math.log10(value))
    for factor, steps in ((1, 5), (2, 4), (2.5, 5), (5, 5), (10, 5)):
        if factor * power >= value * (1 - 1e-12):
            return float(factor * power), steps
    return 10 * power, 5  # pragma: no cover - the loop ends at 10


def compact(value: float) -> str:
    """1234567 → 1.2M, 2500 → 2.5k, 0.5 → 0.5, 12 → 12."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}" if value != int(value) else str(int(value))


def _described(value: float, unit: str) -> str:
    text = f"{value:,.1f}" if value != int(value) else f"{int(value):,}"
    return f"{text} {unit}" if unit else text


def _value(value: float) -> str:
    return str(int(value)) if value == int(value) else f"{value:.3f}"


def _n(value: float) -> str:
    """A coordinate, short."""
    return f"{value:.1f}".rstrip("0").rstrip(".")


def figures(rows: list[tuple[str, str]]) -> SafeString:
    """`(label, value)` pairs as the page's headline figures."""
    return format_html_join("", '<div class="usage-figure"><span>{}</span><strong>{}</strong></div>', rows)
