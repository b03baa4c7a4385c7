"""One way to read a metric: a sample by its exposition name and labels, as `/metrics` shows it
(`tether_aborts_total{engine="vllm",result="ok"}`), through prometheus-client's public API.

Strict on purpose, so a typo cannot make a check pass: a name no metric exposes, or labels
that are not exactly the sample's label names, raise instead of reading as 0. A labelled
metric whose label values never occurred reads as 0, as Prometheus would treat it.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# The samples each metric type exposes besides its family name.
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "unknown": ("",),
}


def metric(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The value of sample `name` with exactly these labels in an in-process registry
    (e.g. `server.context.metrics.registry`)."""
    return _sample_value(registry.collect(), name, labels)


def metric_in_text(exposition: str, name: str, **labels: str) -> float:
    """The same, read from Prometheus text (what another process's `/metrics` answered)."""
    return _sample_value(text_string_to_metric_families(exposition), name, labels)


def _sample_value(families: Iterable[Metric], name: str, labels: dict[str, str]) -> float:
    exposed: list[str] = []
    for family in families:
        names = [family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))]
        exposed += names
        if name not in names:
            continue
        samples = [sample for sample in family.samples if sample.name == name]
        for sample in samples:
            label_names = set(sample.labels)
            if set(labels) != label_names:
                raise ValueError(
                    f"{name} has the labels {sorted(label_names)}; got {sorted(labels)}"
                )
            if sample.labels == labels:
                return float(sample.value)
        return 0.0
    raise KeyError(f"no metric exposes {name!r}; known samples: {sorted(exposed)}")
