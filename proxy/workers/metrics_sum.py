"""The workers' metrics as one process's: their expositions parsed and summed.

Samples of the same name and labels add up (counters, histogram buckets, sums and counts,
gauges that count, like requests in flight); a gauge that is a state is the minimum over the
workers instead (`tether_upstream_ready` is 1 only if every worker's engine check passes),
and one that is a measurement the largest (the age of a cluster of cuts one worker saw).
A worker that exits takes its counts with it; the supervisor keeps them as of its last scrape
(`cumulative`, added as `retired`) so the sums never go down, which Prometheus would read
as a counter reset.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

# Gauges whose value is a state (1 or 0) of each worker, not a count.
STATE_GAUGES = frozenset({"tether_upstream_ready", "tether_engine_info"})
# Gauges whose value is something each worker measured: summed it would mean nothing.
MEASURED_GAUGES = frozenset({"tether_client_cut_cluster_age_seconds"})

_SampleKey = tuple[str, tuple[tuple[str, str], ...]]


class Family:
    """One metric's samples, summed over workers, in the order the first worker gave them."""

    __slots__ = ("documentation", "name", "samples", "type")

    def __init__(self, name: str, documentation: str, kind: str) -> None:
        self.name = name
        self.documentation = documentation
        self.type = kind
        self.samples: dict[_SampleKey, float] = {}

    def add(self, key: _SampleKey, value: float) -> None:
        known = self.samples.get(key)
        if known is None:
            self.samples[key] = value
        elif self.name in STATE_GAUGES:
            self.samples[key] = min(known, value)
        elif self.name in MEASURED_GAUGES:
            self.samples[key] = max(known, value)
        else:
            self.samples[key] = known + value

    def metric(self) -> Metric:
        metric = Metric(self.name, self.documentation, self.type)
        for (sample_name, labels), value in self.samples.items():
            metric.add_sample(sample_name, dict(labels), value)
        return metric


def parse(exposition: str) -> list[Metric]:
    """One worker's exposition as metric families."""
    return list(text_string_to_metric_families(exposition))


def summed(workers: Iterable[Iterable[Metric]], retired: Iterable[Metric] = ()) -> Iterator[Metric]:
    """Every family of every worker, summed; `retired` adds the counts of exited workers
    (counters and histograms only: their gauges ended with them)."""
    families: dict[str, Family] = {}
    for metrics in (*workers, retired):
        for metric in metrics:
            family = families.get(metric.name)
            if family is None:
                family = families[metric.name] = Family(
                    metric.name, metric.documentation, metric.type
                )
            for sample in metric.samples:
                family.add((sample.name, tuple(sorted(sample.labels.items()))), sample.value)
    for family in families.values():
        yield family.metric()


def cumulative(metrics: Iterable[Metric]) -> list[Metric]:
    """The families of `metrics` that only grow (counters, histograms): what an exited
    worker leaves to the sums."""
    return [metric for metric in metrics if metric.type in ("counter", "histogram")]
