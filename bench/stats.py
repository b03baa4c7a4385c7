"""Percentile summaries, the one way every latency in the benchmark is reduced."""

from __future__ import annotations

import math
from collections.abc import Sequence

QUANTILES = {"p50": 0.50, "p99": 0.99, "p99.9": 0.999}


def summarize_us(samples_ns: Sequence[int]) -> dict[str, float]:
    """Nearest-rank p50/p99/p99.9 and max, in microseconds, plus the sample count."""
    if not samples_ns:
        return {"count": 0}
    ordered = sorted(samples_ns)
    summary: dict[str, float] = {"count": len(ordered)}
    for name, q in QUANTILES.items():
        summary[name] = ordered[max(0, math.ceil(q * len(ordered)) - 1)] / 1000
    summary["max"] = ordered[-1] / 1000
    return summary
