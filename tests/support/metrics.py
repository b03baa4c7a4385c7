"""Reading metrics, all through prometheus-client's public API.

`metric` and `metric_in_text`: a sample by its exposition name and labels, as `/metrics` shows
it (`tether_aborts_total{engine="vllm",result="ok"}`). Strict on purpose, so a typo cannot make
a check pass: a name no metric exposes, or labels that are not exactly the sample's label
names, raise instead of reading as 0. A labelled metric whose label values never occurred
reads as 0, as Prometheus would treat it.

`scrape` and `MetricsSnapshot`: what the real-engine suites read of a real engine's (or a
tether process's) `/metrics`, where an engine adds labels of its own (model name, engine
index): a value is the sum over every sample whose labels include the ones named, 0 if none.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from .blocking_http import http_get

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


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape of a Prometheus endpoint: every sample, as (name, labels, value)."""

    samples: tuple[tuple[str, dict[str, str], float], ...]

    def value(self, name: str, **labels: str) -> float:
        """Sum of every sample called `name` whose labels include `labels` (0 if none)."""
        return sum(
            value
            for sample_name, sample_labels, value in self.samples
            if sample_name == name and all(sample_labels.get(k) == v for k, v in labels.items())
        )

    def buckets(self, histogram: str) -> dict[float, float]:
        """A histogram's cumulative bucket counts by upper bound (`+Inf` as infinity)."""
        return {
            float(labels["le"]): value
            for name, labels, value in self.samples
            if name == histogram + "_bucket"
        }


def parse_metrics(exposition: str) -> MetricsSnapshot:
    """The samples of Prometheus text."""
    return MetricsSnapshot(
        tuple(
            (sample.name, dict(sample.labels), float(sample.value))
            for family in text_string_to_metric_families(exposition)
            for sample in family.samples
        )
    )


def scrape(url: str) -> MetricsSnapshot:
    """GET `url` (blocking) and parse it; anything but 200 fails."""
    status, body = http_get(url)
    assert status == 200, f"GET {url} answered {status}"
    return parse_metrics(body.decode())


def histogram_quantile(
    quantile: float, before: MetricsSnapshot, after: MetricsSnapshot, histogram: str
) -> float:
    """What Prometheus' `histogram_quantile` says of the observations between two scrapes:
    linear interpolation inside the bucket the quantile falls in (NaN with none)."""
    start = before.buckets(histogram)
    counts = sorted(
        (le, value - start.get(le, 0.0)) for le, value in after.buckets(histogram).items()
    )
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return math.nan
    rank = quantile * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in counts:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # beyond the last finite bucket: its bound, as Prometheus
            inside = count - lower_count
            share = (rank - lower_count) / inside if inside else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound
