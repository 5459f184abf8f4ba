"""messages_api/usage_chart.py: the usage page's charts, their scale, numbers and escaping."""

from __future__ import annotations

from messages_api.usage_chart import Series, chart, compact, nice_ceiling


def test_chart_scale_and_numbers() -> None:
    assert [nice_ceiling(v) for v in (0, 0.3, 1, 7, 11, 240, 260, 999)] == [1, 0.5, 1, 10, 20, 250, 500, 1000]
    assert [compact(v) for v in (0, 12, 0.5, 2500, 1_234_567)] == ["0", "12", "0.5", "2.5k", "1.23M"]


def test_chart_escapes_its_text_and_has_a_point_per_value() -> None:
    svg = chart("<t>", ["a", "b", "<c>"], [Series("x<y", "#000", [1, 2, 3]), Series("z", "#111", [0, 0, 4])], kind="bars")
    assert "<t>" not in svg and "<c>" not in svg and "x<y" not in svg
    assert svg.count('class="point"') == 6
    assert 'data-value="4"' in svg
    lines = chart("l", ["a", "b"], [Series("s", "#000", [1.5, 0])], kind="lines")
    assert lines.count("<circle") == 2 and 'data-value="1.500"' in lines
