"""Prometheus metrics, in a registry of the app's own (no process-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from .registry import Outcome

# Routes known by name; anything else is counted as "other" so label values stay bounded.
# The probes and scrapes routers send to the pod's serving port (endpoint pickers, the
# production-stack router) have labels of their own, so they never pass for generation.
GENERATION_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/v1/embeddings",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/v1/rerank",
        "/v1/score",
        "/generate",
        "/generate_stream",
        "/invocations",
    }
)
KNOWN_ROUTES = GENERATION_ROUTES | frozenset(
    {
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/health_generate",
        "/metrics",
        "/version",
        "/ping",
        "/load",
        "/v1/loads",
        "/get_model_info",
        "/get_server_info",
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
            "Requests tether stopped at the engine, by engine and result: confirmed (the "
            "engine ended the response within TETHER_ABORT_CONFIRM_TIMEOUT), unconfirmed (the "
            "abort call was accepted, the response went on; connection dropped), "
            "not_supported (no abort route; connection dropped), unknown_route (tether cannot "
            "name the engine's ID on this route; connection dropped), failed (the abort call "
            "failed; connection dropped).",
            ["engine", "result"],
            registry=r,
        )
        self.abort_latency = Histogram(
            "tether_abort_latency_seconds",
            "From the disconnect to the engine accepting the abort call.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.engine_stop = Histogram(
            "tether_engine_stop_seconds",
            "From the disconnect to the end of the engine's response, for confirmed aborts.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens_relayed = Counter(
            "tether_tokens_relayed",
            "Completion tokens relayed to clients, by route: the engine's usage count where "
            "it reports one, else token-carrying stream events (one token each with vLLM's "
            "and SGLang's default stream settings).",
            ["route"],
            registry=r,
        )
        self.tokens_after_disconnect = Counter(
            "tether_tokens_after_disconnect",
            "Completion tokens the engine produced after the client left, up to the end of "
            "its response (aborts that the engine accepted; a non-streaming answer the client "
            "never received counts whole). Counted as tether_tokens_relayed_total is.",
            ["route"],
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
        tokens: int,
    ) -> None:
        """Everything counted once per request tether forwarded."""
        self._count_ending(route, status, outcome)
        self._child(self.duration, route).observe(duration)  # type: ignore[attr-defined]
        if bytes_out:
            self.bytes_streamed.inc(bytes_out)
        if sse_events:
            self.sse_events.inc(sse_events)
        if tokens:
            self._child(self.tokens_relayed, route).inc(tokens)  # type: ignore[attr-defined]

    def record_tokens_after_disconnect(self, route: str, tokens: int) -> None:
        child = self._child(self.tokens_after_disconnect, route)
        child.inc(tokens)  # type: ignore[attr-defined]

    def count_abort(self, engine: str, result: str) -> None:
        self._child(self.aborts, engine, result).inc()  # type: ignore[attr-defined]

    def record_rejection(self, route: str, status: int) -> None:
        """A request refused before anything was forwarded (no duration to speak of)."""
        self._count_ending(route, status, Outcome.REJECTED.value)

    def _count_ending(self, route: str, status: int, outcome: str) -> None:
        self._child(self.requests, route, f"{status // 100}xx").inc()  # type: ignore[attr-defined]
        self._child(self.outcomes, outcome).inc()  # type: ignore[attr-defined]

    def record_first_byte(self, route: str, seconds: float) -> None:
        self._child(self.time_to_first_byte, route).observe(seconds)  # type: ignore[attr-defined]
