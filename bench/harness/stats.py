"""Distributions (percentiles as numpy computes them) and the tables the scripts print."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); q in [0, 100]."""
    if not sorted_values:
        return math.nan
    if len(sorted_values) == 1:
        return float(sorted_values[0])
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    return float(sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (rank - low))


def distribution(values: Iterable[float]) -> dict[str, float]:
    data = sorted(values)
    if not data:
        return {"n": 0}
    return {
        "n": len(data),
        "min": float(data[0]),
        "p50": percentile(data, 50),
        "p90": percentile(data, 90),
        "p99": percentile(data, 99),
        "max": float(data[-1]),
        "mean": sum(data) / len(data),
    }


def _fmt(value: Any, digits: int = 2) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    return str(value)


def print_table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 2) -> None:
    cells = [[_fmt(c, digits) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    print(f"\n{title}")
    line = "  ".join(h.ljust(widths[0]) if i == 0 else h.rjust(widths[i]) for i, h in enumerate(headers))
    print(line)
    print("-" * len(line))
    for row in cells:
        print("  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)))


DIST_HEADERS = ("", "n", "min", "p50", "p90", "p99", "max")


def dist_row(label: str, dist: dict[str, float], scale: float = 1.0) -> list[Any]:
    if not dist.get("n"):
        return [label, 0, "-", "-", "-", "-", "-"]
    return [label, int(dist["n"])] + [dist[k] * scale for k in ("min", "p50", "p90", "p99", "max")]


def print_distributions(title: str, rows: Sequence[tuple[str, dict[str, float]]], unit_scale: float = 1.0, digits: int = 2) -> None:
    print_table(title, DIST_HEADERS, [dist_row(label, d, unit_scale) for label, d in rows], digits)


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"
