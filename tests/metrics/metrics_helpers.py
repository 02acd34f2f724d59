"""What the metrics tests share: a text-format file or page parsed with
prometheus_client's own parser, as samples by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def samples(text: str) -> Samples:
    """{sample name: {sorted labels: value}} of a Prometheus text exposition."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def one(got: Samples, name: str, **labels: str) -> float:
    """The value of the one sample `name` with exactly `labels`."""
    return got[name][tuple(sorted(labels.items()))]
