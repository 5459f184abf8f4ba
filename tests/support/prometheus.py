"""Reading the gateway's `/metrics` scrape in tests."""

from __future__ import annotations


def metric_value(text: str, name: str, **labels: str) -> float:
    """The value of the sample `name` whose labels include `labels` (Prometheus text format)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    raise AssertionError(f"no sample {name} {labels}")
