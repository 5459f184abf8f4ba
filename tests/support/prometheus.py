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


def metric_total(text: str, name: str) -> float:
    """The sum of every sample `name` (any labels) in a Prometheus text scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples if sample.name == name)
