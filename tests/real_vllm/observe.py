"""Reading what the real processes say: Prometheus text, vLLM's log, and polling with a deadline."""

from __future__ import annotations

import json
import math
import pathlib
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.005
) -> float:
    """Poll `predicate` until it holds; return the seconds it took, fail after `timeout`."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)


def http_get(
    url: str, timeout: float = 5.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """GET `url`; return (status, body) for any status, raise only on connection errors."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def http_post_json(
    url: str, payload: Any, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    """POST JSON; return (status, headers, body) for any status."""
    data = json.dumps(payload).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=all_headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers.items()), error.read()


@dataclass(frozen=True)
class MetricsSnapshot:
    """One scrape of a Prometheus endpoint."""

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


def parse_prometheus(text: str) -> MetricsSnapshot:
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, label_text, value = match.groups()
        labels = dict(_LABEL.findall(label_text or ""))
        samples.append((name, labels, float(value)))
    return MetricsSnapshot(tuple(samples))


def scrape(url: str) -> MetricsSnapshot:
    status, body = http_get(url)
    assert status == 200, f"GET {url} answered {status}"
    return parse_prometheus(body.decode())


class LogFile:
    """A log file another process writes; tests read what was appended after a mark."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def text_since(self, mark: int) -> str:
        with self.path.open("rb") as handle:
            handle.seek(mark)
            return handle.read().decode(errors="replace")

    def find_since(self, mark: int, pattern: str) -> list[re.Match[str]]:
        return list(re.finditer(pattern, self.text_since(mark), re.MULTILINE))

    def wait_for(self, mark: int, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        """The first match of `pattern` written after `mark`, waiting up to `timeout`."""
        found: list[re.Match[str]] = []

        def appeared() -> bool:
            found[:] = self.find_since(mark, pattern)
            return bool(found)

        wait_until(appeared, timeout, f"{pattern!r} in {self.path.name}", interval=0.02)
        return found[0]

    def json_lines(self, mark: int, event: str | None = None) -> list[dict[str, Any]]:
        """The JSON log lines (tether's) written after `mark`, only those of `event` if given."""
        found = []
        for line in self.text_since(mark).splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and (event is None or entry.get("event") == event):
                found.append(entry)
        return found

    def wait_json(
        self, mark: int, event: str, timeout: float = 10.0, **fields: object
    ) -> dict[str, Any]:
        """The first JSON line of `event` with these field values written after `mark`,
        waiting up to `timeout`."""
        found: list[dict[str, Any]] = []

        def appeared() -> bool:
            found[:] = [
                entry
                for entry in self.json_lines(mark, event)
                if all(entry.get(key) == value for key, value in fields.items())
            ]
            return bool(found)

        wait_until(appeared, timeout, f"{event} {fields} in {self.path.name}", interval=0.02)
        return found[0]

    def tail(self, lines: int = 60) -> str:
        if not self.path.exists():
            return "(no log)"
        return "\n".join(self.path.read_text(errors="replace").splitlines()[-lines:])
