"""Prometheus metrics, in a registry of the app's own (no process-global state).

tether counts in plain Python numbers, touched on every request (and some on every abort),
and hands them to prometheus-client only when /metrics is scraped: its own metric objects
take a lock and do label bookkeeping on every update, which cost more per request than the
rest of the accounting together. tether runs on one event loop thread, so no lock is
needed.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from ..engines import GENERATION_ROUTES, PROBE_ROUTES
from ..outcomes import Outcome

# Routes known by name (every engine's generation routes, `proxy.engines`); anything else is
# counted as "other" so label values stay bounded. The probes and scrapes routers send to the
# pod's serving port (endpoint pickers, the production-stack router) have labels of their
# own, so they never pass for generation.
KNOWN_ROUTES = GENERATION_ROUTES | PROBE_ROUTES

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Ages at a cut: an edge half a second either side of each idle timeout intermediaries are
# known to use (Higress 10 s, Envoy 15 s, AWS ALB and nginx 60 s, ...), so a cut by one of
# them lands in a bucket of its own: (59.5, 60.5] is "cut at 60 s".
_IDLE_TIMEOUTS = (1, 5, 10, 15, 30, 60, 120, 300, 600)
_CUT_AGE_BUCKETS = tuple(edge for idle in _IDLE_TIMEOUTS for edge in (idle - 0.5, idle + 0.5))


# The `code` label by a status' first digit (1xx to 5xx; aiohttp answers nothing else).
_STATUS_CLASSES = tuple(f"{digit}xx" for digit in range(10))


def route_label(path: str) -> str:
    path = path.rstrip("/") or "/"
    return path if path in KNOWN_ROUTES else "other"


class Counter:
    """A counter with a fixed set of label names; its series by label values."""

    __slots__ = ("documentation", "labelnames", "name", "values")

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        # Without labels the one series exists from the start (0, not absent).
        self.values: dict[tuple[str, ...], float] = {} if labelnames else {(): 0.0}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def family(self) -> Metric:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.values.items():
            family.add_metric(labels, value)
        return family


class Gauge:
    __slots__ = ("documentation", "name", "value")

    def __init__(self, name: str, documentation: str) -> None:
        self.name = name
        self.documentation = documentation
        self.value = 0.0

    def family(self) -> Metric:
        return GaugeMetricFamily(self.name, self.documentation, value=self.value)


class LabelledGauge:
    """A gauge with a fixed set of label names; its series by label values, each set as a
    whole."""

    __slots__ = ("documentation", "labelnames", "name", "values")

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, value: float, *labels: str) -> None:
        self.values[labels] = value

    def family(self) -> Metric:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in self.values.items():
            family.add_metric(labels, value)
        return family


class Info:
    """A gauge of value 1 whose labels say what something is (Prometheus' info pattern)."""

    __slots__ = ("documentation", "labelnames", "labels", "name")

    def __init__(self, name: str, documentation: str, labelnames: tuple[str, ...]) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self.labels: tuple[str, ...] | None = None  # not known yet: no series

    def family(self) -> Metric:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        if self.labels is not None:
            family.add_metric(self.labels, 1)
        return family


class Histogram:
    """A histogram with fixed buckets; each series is its per-bucket counts and sum."""

    __slots__ = ("_bounds", "documentation", "labelnames", "name", "series")

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: tuple[float, ...],
        labelnames: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = labelnames
        self._bounds = tuple(float(bound) for bound in buckets)
        # Per label values: a count per bucket (the last one is +Inf) and the sum. Without
        # labels the one series exists from the start.
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}
        if not labelnames:
            self.series[()] = ([0] * (len(buckets) + 1), [0.0])

    def observe(self, value: float, *labels: str) -> None:
        series = self.series.get(labels)
        if series is None:
            series = self.series[labels] = ([0] * (len(self._bounds) + 1), [0.0])
        # The first bucket whose bound is not below `value` (bisect_left's answer; a compiled
        # scan over a dozen bounds costs less than the call).
        index = 0
        for bound in self._bounds:
            if bound >= value:
                break
            index += 1
        series[0][index] += 1
        series[1][0] += value

    def family(self) -> Metric:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        bounds = [repr(bound) for bound in self._bounds] + ["+Inf"]  # (floats already)
        for labels, (counts, total) in self.series.items():
            cumulative, buckets = 0, []
            for bound, count in zip(bounds, counts, strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(labels, buckets, total[0])
        return family


class Metrics:
    """Every metric tether exports. One instance per app."""

    def __init__(self) -> None:
        self.requests = Counter(
            "tether_requests",
            "Requests finished, by route and status class (499: client left).",
            ("route", "status_class"),
        )
        self.outcomes = Counter(
            "tether_request_outcomes", "Requests finished, by how they ended.", ("outcome",)
        )
        self.in_flight = Gauge("tether_requests_in_flight", "Requests in flight.")
        self.client_disconnects = Counter(
            "tether_client_disconnects",
            "Clients that left before their response was complete, and whose engine work "
            "tether then stopped, by phase (every cut, with its cause: "
            "tether_client_cut_age_seconds).",
            ("phase",),
        )
        self.client_cut_age = Histogram(
            "tether_client_cut_age_seconds",
            "Client requests cut before their answer was complete, by route and cause, and "
            "their age then (from the request's arrival to the moment tether noticed the "
            "cut): client_closed (FIN), client_reset (RST), keepalive_timeout (TCP keepalive "
            "probes unanswered), write_failed (tether's write found the connection closing), "
            "connection_error (any other socket error), or tether's own timeout by its "
            "setting (request_timeout, stream_idle_timeout, client_body_timeout, "
            "connect_timeout). Its _count is the number of cuts.",
            _CUT_AGE_BUCKETS,
            ("route", "cause"),
        )
        self.client_cut_clusters = Counter(
            "tether_client_cut_clusters",
            "Times 3 or more cuts of one route (FIN, RST or a failed write, within 10 "
            "minutes) fell at the same age within half a second: likely an idle timeout in "
            "front of tether (counted once per route and age in 10 minutes).",
            ("route",),
        )
        self.client_cut_cluster_age = LabelledGauge(
            "tether_client_cut_cluster_age_seconds",
            "The age at which the latest cluster of cuts of this route fell "
            "(tether_client_cut_clusters_total).",
            ("route",),
        )
        self.upstream_cancels = Counter(
            "tether_upstream_cancellations",
            "Upstream requests tether stopped (connection dropped), by reason.",
            ("reason",),
        )
        self.aborts = Counter(
            "tether_aborts",
            "Requests tether stopped at the engine, by engine and result: confirmed (the "
            "engine ended the response within TETHER_ABORT_CONFIRM_TIMEOUT), unconfirmed (the "
            "abort call was accepted, the response went on; connection dropped), "
            "not_supported (no abort route; connection dropped), unknown_route (tether cannot "
            "name the engine's ID on this route; connection dropped), failed (the abort call "
            "failed; connection dropped).",
            ("engine", "result"),
        )
        self.cancellations = Counter(
            "tether_cancellations",
            "Cancel-by-ID calls on the serving port (one per ID asked), by result: how the "
            "engine's work stopped (confirmed, unconfirmed, dropped, not_supported, "
            "unknown_route, failed, not_sent, left_running, pending), peer (held by another "
            "replica), not_found (no request of the caller's with that ID in flight), "
            "rate_limited (the connection's failed attempts ran out).",
            ("result",),
        )
        self.abort_latency = Histogram(
            "tether_abort_latency_seconds",
            "From the disconnect to the engine accepting the abort call.",
            _LATENCY_BUCKETS,
        )
        self.engine_stop = Histogram(
            "tether_engine_stop_seconds",
            "From the disconnect to the end of the engine's response, for confirmed aborts.",
            _LATENCY_BUCKETS,
        )
        self.tokens_relayed = Counter(
            "tether_tokens_relayed",
            "Completion tokens relayed to clients, by route: the engine's usage count where "
            "it reports one, else token-carrying stream events (one token each while the "
            "engine's HTTP handler keeps up; vLLM and SGLang merge tokens into one event when "
            "it falls behind, so then the count is a lower bound).",
            ("route",),
        )
        self.tokens_after_disconnect = Counter(
            "tether_tokens_after_disconnect",
            "Completion tokens the engine produced after the client left, up to the end of "
            "its response (aborts that the engine accepted; a non-streaming answer the client "
            "never received counts whole). Counted as tether_tokens_relayed_total is.",
            ("route",),
        )
        self.prompt_tokens = Counter(
            "tether_prompt_tokens",
            "Prompt tokens of the requests tether forwarded, by route, as the engine counts "
            "them (abandoned requests included wherever tether read the end of the response).",
            ("route",),
        )
        self.upstream_errors = Counter(
            "tether_upstream_errors", "Upstream failures, by kind.", ("kind",)
        )
        self.duration = Histogram(
            "tether_request_duration_seconds",
            "Whole request duration, by route.",
            _DURATION_BUCKETS,
            ("route",),
        )
        self.time_to_first_byte = Histogram(
            "tether_time_to_first_byte_seconds",
            "From the request's arrival to the first response body byte from the engine.",
            _DURATION_BUCKETS,
            ("route",),
        )
        self.bytes_streamed = Counter(
            "tether_response_bytes", "Response body bytes sent to clients."
        )
        self.sse_events = Counter("tether_sse_events", "Server-sent events relayed to clients.")
        self.upstream_ready = Gauge(
            "tether_upstream_ready", "1 while the engine's health check passes."
        )
        self.engine_info = Info(
            "tether_engine_info",
            "The engine tether fronts: the TETHER_ENGINE setting (configured), what the engine "
            "said it is (identified: vllm, sglang, llamacpp, tgi, ollama, or unknown), its "
            "version, and the profile tether serves it with.",
            ("configured", "identified", "version", "profile"),
        )
        self.websocket_sessions_open = Gauge(
            "tether_websocket_sessions_open", "WebSocket sessions being relayed now."
        )
        self.streamed_uploads = Gauge(
            "tether_streamed_uploads",
            "Engine connections held now for requests whose body is still arriving (streamed "
            "through) or whose WebSocket handshake awaits the engine's answer; at "
            "TETHER_MAX_STREAMED_UPLOADS more are refused with 503.",
        )
        self.websocket_sessions = Counter(
            "tether_websocket_sessions",
            "WebSocket sessions relayed, by how they ended: completed (the engine closed "
            "it), client_disconnected (the client's connection closed first; tether then "
            "closed the engine's), timed_out, shutdown_aborted, admin_aborted, "
            "upstream_failed.",
            ("outcome",),
        )
        self.stream_holds = Counter(
            "tether_stream_holds",
            "Streams held after their client's connection dropped (TETHER_RESUME_GRACE), by "
            "how the hold ended: resumed (a resume took it over; counted once per resume), "
            "lapsed (no resume within the grace, or more held than TETHER_RESUME_BUFFER: "
            "the engine's work was stopped).",
            ("result",),
        )
        self.streams_held = Gauge(
            "tether_streams_held", "Streams held for a resume now, their client away."
        )
        self.engine_queue = Gauge(
            "tether_engine_queue",
            "Generation requests waiting in tether for a free engine slot (TETHER_ENGINE_SLOTS: "
            "the engine's own queue would not notice their clients leaving).",
        )
        self.engine_slots = Gauge(
            "tether_engine_slots",
            "The engine slots tether counts (TETHER_ENGINE_SLOTS); 0: not counted.",
        )
        self._all: tuple[Counter | Gauge | LabelledGauge | Info | Histogram, ...] = (
            self.requests,
            self.outcomes,
            self.in_flight,
            self.client_disconnects,
            self.client_cut_age,
            self.client_cut_clusters,
            self.client_cut_cluster_age,
            self.upstream_cancels,
            self.aborts,
            self.cancellations,
            self.abort_latency,
            self.engine_stop,
            self.tokens_relayed,
            self.tokens_after_disconnect,
            self.prompt_tokens,
            self.upstream_errors,
            self.duration,
            self.time_to_first_byte,
            self.bytes_streamed,
            self.sse_events,
            self.upstream_ready,
            self.engine_info,
            self.websocket_sessions_open,
            self.websocket_sessions,
            self.streamed_uploads,
            self.stream_holds,
            self.streams_held,
            self.engine_queue,
            self.engine_slots,
        )
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(self)

    def collect(self) -> Iterator[Metric]:
        """prometheus-client's collector protocol: every family as it stands now."""
        for metric in self._all:
            yield metric.family()

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
        self.duration.observe(duration, route)
        if bytes_out:
            self.bytes_streamed.inc(amount=bytes_out)
        if sse_events:
            self.sse_events.inc(amount=sse_events)
        if tokens:
            self.tokens_relayed.inc(route, amount=tokens)

    def record_websocket_session(self, outcome: str) -> None:
        self.websocket_sessions.inc(outcome)

    def record_rejection(self, route: str, status: int) -> None:
        """A request refused before anything was forwarded (no duration to speak of)."""
        self._count_ending(route, status, Outcome.REJECTED.value)

    def record_tokens_after_disconnect(self, route: str, tokens: int) -> None:
        self.tokens_after_disconnect.inc(route, amount=tokens)

    def record_prompt_tokens(self, route: str, tokens: int) -> None:
        if tokens:
            self.prompt_tokens.inc(route, amount=tokens)

    def record_cut(self, route: str, cause: str, age: float) -> None:
        self.client_cut_age.observe(age, route, cause)

    def record_cut_cluster(self, route: str, age: float) -> None:
        self.client_cut_clusters.inc(route)
        self.client_cut_cluster_age.set(age, route)

    def count_abort(self, engine: str, result: str) -> None:
        self.aborts.inc(engine, result)

    def _count_ending(self, route: str, status: int, outcome: str) -> None:
        self.requests.inc(route, _STATUS_CLASSES[status // 100])
        self.outcomes.inc(outcome)

    def record_first_byte(self, route: str, seconds: float) -> None:
        self.time_to_first_byte.observe(seconds, route)
