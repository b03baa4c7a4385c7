"""Prometheus metrics, in a registry of the app's own (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from .registry import Outcome

# Routes known by name; anything else is counted as "other" so label values stay bounded.
KNOWN_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/models",
        "/v1/audio/transcriptions",
        "/v1/rerank",
        "/v1/score",
        "/generate",
        "/generate_stream",
        "/tokenize",
        "/detokenize",
        "/health",
        "/invocations",
    }
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def route_label(path: str) -> str:
    path = path.rstrip("/") or "/"
    return path if path in KNOWN_ROUTES else "other"


class Metrics:
    """Every metric tether exports. One instance per app."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "tether_requests",
            "Requests finished, by route and status class (499: client left).",
            ["route", "status_class"],
            registry=r,
        )
        self.outcomes = Counter(
            "tether_request_outcomes",
            "Requests finished, by how they ended.",
            ["outcome"],
            registry=r,
        )
        self.in_flight = Gauge("tether_requests_in_flight", "Requests in flight.", registry=r)
        self.client_disconnects = Counter(
            "tether_client_disconnects",
            "Clients that left before their response was complete, by phase.",
            ["phase"],
            registry=r,
        )
        self.upstream_cancels = Counter(
            "tether_upstream_cancellations",
            "Upstream requests tether stopped (connection dropped), by reason.",
            ["reason"],
            registry=r,
        )
        self.aborts = Counter(
            "tether_aborts",
            "Abort calls to the engine, by engine and result.",
            ["engine", "result"],
            registry=r,
        )
        self.abort_latency = Histogram(
            "tether_abort_latency_seconds",
            "From the disconnect to the engine's answer to the abort call.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "tether_upstream_errors",
            "Upstream failures, by kind.",
            ["kind"],
            registry=r,
        )
        self.duration = Histogram(
            "tether_request_duration_seconds",
            "Whole request duration, by route.",
            ["route"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.time_to_first_byte = Histogram(
            "tether_time_to_first_byte_seconds",
            "From the request's arrival to the first response body byte from the engine.",
            ["route"],
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.bytes_streamed = Counter(
            "tether_response_bytes", "Response body bytes sent to clients.", registry=r
        )
        self.sse_events = Counter(
            "tether_sse_events", "Server-sent events relayed to clients.", registry=r
        )
        self.upstream_ready = Gauge(
            "tether_upstream_ready", "1 while the engine's health check passes.", registry=r
        )

        # Labelled children, looked up once per label set: `labels()` takes a lock and builds
        # keys, and these are hit on every request. The label sets are bounded (KNOWN_ROUTES,
        # status classes, outcomes).
        self._children: dict[tuple[object, ...], MetricWrapperBase] = {}

    def _child(self, metric: MetricWrapperBase, *labels: str) -> MetricWrapperBase:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record_request(
        self,
        route: str,
        status: int,
        outcome: str,
        duration: float,
        bytes_out: int,
        sse_events: int,
    ) -> None:
        """Everything counted once per request tether forwarded."""
        self._count_ending(route, status, outcome)
        self._child(self.duration, route).observe(duration)  # type: ignore[attr-defined]
        if bytes_out:
            self.bytes_streamed.inc(bytes_out)
        if sse_events:
            self.sse_events.inc(sse_events)

    def record_rejection(self, route: str, status: int) -> None:
        """A request refused before anything was forwarded (no duration to speak of)."""
        self._count_ending(route, status, Outcome.REJECTED.value)

    def _count_ending(self, route: str, status: int, outcome: str) -> None:
        self._child(self.requests, route, f"{status // 100}xx").inc()  # type: ignore[attr-defined]
        self._child(self.outcomes, outcome).inc()  # type: ignore[attr-defined]

    def record_first_byte(self, route: str, seconds: float) -> None:
        self._child(self.time_to_first_byte, route).observe(seconds)  # type: ignore[attr-defined]
