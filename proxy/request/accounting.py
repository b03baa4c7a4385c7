"""How each request ended, reported once: the `request_finished` (or `request_rejected`)
line, the metrics and the span, from the one record the handler leaves (`RequestState` and
its `Ending`). The handler decides; nothing else in the request's path says what happened.

A client's connection found gone is recorded twice: as a cut when it is noticed
(`connection_cut`: its cause and the request's age then), and as abandoned once tether stops
the engine's work for it (`client_left`). tether's own timeouts are cuts too, recorded from
the request's ending.

A request whose engine work tether is still stopping (an abort waiting to be confirmed) is
counted when its handler ends, and its line and span follow once the engine's work has
stopped, with the tokens the engine produced after the client left.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping

import structlog

from ..errors import TetherError, UpstreamError
from ..observe.cut_clusters import Cluster, CutClusters
from ..observe.cuts import FROM_OUTSIDE, LostConnections
from ..observe.metrics import Metrics, route_label
from ..observe.tracing import Tracer
from ..outcomes import Outcome
from .state import Ending, RequestState

# The request log. (Resolved once per app, in `Accounting`: through structlog's lazy proxy
# every call assembles its logger again, some 0.5 µs per request even for a line not written.)
_LOGGER_NAME = "tether.request"

# The handler ended without deciding how (a BaseException tether does not catch).
_UNDECIDED = Ending(Outcome.INTERNAL_ERROR, 500)


class Accounting:
    """Counts and reports requests: one per app."""

    __slots__ = ("_clusters", "_log", "_metrics", "_tracer", "lost")

    def __init__(self, metrics: Metrics, tracer: Tracer | None) -> None:
        self._metrics = metrics
        self._tracer = tracer
        # (logging is configured before the app is built: `server.boot`)
        self._log: structlog.typing.FilteringBoundLogger = structlog.get_logger(_LOGGER_NAME).bind()
        # Why each client connection was lost, written by the client port's server
        # (`server.runner.ClientServer`) before it cancels the connection's handler.
        self.lost = LostConnections()
        self._clusters = CutClusters()

    # --- a request's life ----------------------------------------------------------------------

    def began(self, state: RequestState, headers: Mapping[str, str]) -> None:
        """A request was registered: it is in flight, and its span (with tracing) begins."""
        if self._tracer is not None:
            state.span = self._tracer.start(state.method, state.route_label, headers)
        self._metrics.in_flight.value += 1

    def connection_cut(self, state: RequestState) -> None:
        """The client's connection was found gone before its answer was complete: the cut's
        cause and the request's age at that moment (seconds since it arrived, to when tether
        noticed), whatever then becomes of the engine's work."""
        now = time.monotonic()
        age = now - state.started_at
        cause = self.lost.cause(state.connection)
        route = state.route_label
        self._metrics.record_cut(route, cause.value, age)
        self._log.info("client_connection_cut", cause=cause.value, age_seconds=round(age, 3))
        if state.span is not None:
            state.span.event("client_connection_cut", cause=cause.value, age_seconds=age)
            state.span.set(cut_cause=cause.value)
        if cause in FROM_OUTSIDE:
            cluster = self._clusters.add(route, age, cause.value, now)
            if cluster is not None:
                self._clustered(cluster)

    def _clustered(self, cluster: Cluster) -> None:
        """Cuts of one route keep falling at the same age: said once, with its likely cause."""
        self._metrics.record_cut_cluster(cluster.route, cluster.age)
        self._log.warning(
            "client_cuts_clustered",
            route=cluster.route,
            age_seconds=cluster.age,
            cuts=cluster.cuts,
            causes=list(cluster.causes),
            likely_cause=f"something in front of tether cuts streams of {cluster.route} at "
            f"{cluster.age} s: a load balancer's or gateway's idle timeout? see "
            "TETHER_SSE_KEEPALIVE",
        )

    def client_left(self, state: RequestState) -> None:
        """The client left before its response was complete, and tether stops the engine's
        work for it: abandoned (its cut was recorded when it was noticed, `connection_cut`)."""
        phase = state.phase.value
        self._metrics.client_disconnects.inc(phase)
        self._log.info(
            "client_disconnected", phase=phase, upstream_contacted=state.upstream_contacted
        )
        if state.span is not None:
            state.span.event("client_disconnected", phase=phase)
            state.span.set(disconnect_phase=phase)

    def stream_held(self, state: RequestState, grace: float) -> None:
        """Its client's connection dropped and its stream is held for a resume."""
        self._metrics.streams_held.value += 1
        self._log.info("stream_held", phase=state.phase.value, grace_seconds=grace)
        if state.span is not None:
            state.span.event("stream_held")

    def stream_resumed(self, state: RequestState) -> None:
        """A resume took over its held stream."""
        self._metrics.streams_held.value -= 1
        self._metrics.stream_holds.inc("resumed")
        self._log.info("stream_resumed")
        if state.span is not None:
            state.span.event("stream_resumed")

    def stream_not_resumed(self, state: RequestState) -> None:
        """No resume came within the grace (or it held more than allowed): it is abandoned."""
        self._metrics.streams_held.value -= 1
        self._metrics.stream_holds.inc("lapsed")

    def websocket_opened(self) -> None:
        self._metrics.websocket_sessions_open.value += 1

    def websocket_closed(self) -> None:
        self._metrics.websocket_sessions_open.value -= 1

    def rejected(
        self,
        method: str,
        path: str,
        headers: Mapping[str, str],
        error: TetherError,
        client_request_id: str | None,
        *,
        path_is_safe: bool = True,
    ) -> None:
        """Refused before anything was forwarded: counted as rejected, never registered.
        Without `path_is_safe` the path stays out of the log (it came with an ID tether
        cannot log)."""
        self._log.log(
            error.log_level,
            "request_rejected",
            method=method,
            path=path if path_is_safe else None,
            status=error.status,
            reason=error.message,
        )
        route = route_label(path)
        self._metrics.record_rejection(route, error.status)
        if self._tracer is not None:
            span = self._tracer.start(method, route, headers)
            span.set(client_request_id=client_request_id, outcome=Outcome.REJECTED.value)
            span.finish(error.status, error.message)
            span.end()

    def ended(self, state: RequestState) -> None:
        """The handler is done with the request: count it now, and report it once the
        engine's work for it has stopped."""
        self._metrics.in_flight.value -= 1
        ending = state.ending or _UNDECIDED
        outcome, status, error = ending.outcome, ending.status, ending.error
        metrics = self._metrics
        now = time.monotonic()
        duration = now - state.started_at
        relay = state.relay
        upstream = state.upstream
        first_byte_at: float | None = None
        if upstream is not None and upstream.head is not None:
            first_byte_at = upstream.first_body_at or now
            metrics.record_first_byte(state.route_label, first_byte_at - state.started_at)
        tokens = 0  # relayed to the client
        if relay is not None:
            if relay.tokens_relayed is not None and not relay.relaying:
                tokens = relay.tokens_relayed
            elif outcome is Outcome.COMPLETED:
                tokens = relay.tokens.total()
            else:
                tokens = relay.tokens.events
        if state.upstream_cancelled:
            metrics.upstream_cancels.inc(outcome.value)
        if isinstance(error, UpstreamError):
            metrics.upstream_errors.inc(error.code)
        if error is not None and error.timeout_setting is not None:
            # tether cut the request on a timeout of its own: named by the setting.
            metrics.record_cut(state.route_label, error.timeout_setting, duration)
        if state.tunnel is not None:
            metrics.record_websocket_session(outcome.value)
        metrics.record_request(
            state.route_label,
            status,
            outcome.value,
            duration,
            state.bytes_out,
            relay.sse_events if relay is not None else 0,
            tokens,
        )
        span = state.span
        if span is not None:
            span.set(
                client_request_id=state.client_request_id,
                internal_request_id=state.internal_request_id,
                outcome=outcome.value,
                tokens_relayed=tokens,
                cut_cause=error.timeout_setting if error is not None else None,
            )
            span.finish(status, error.message if error is not None else None)
        level = error.log_level if error is not None else logging.INFO
        line: dict[str, object] | None = None
        if self._log.is_enabled_for(level):  # else the line's fields are not even assembled
            ttfb = first_byte_at - state.started_at if first_byte_at is not None else None
            line = {
                "method": state.method,
                "path": state.path,
                "status": status,
                "outcome": outcome.value,
                "duration_ms": round(duration * 1000, 2),
                "ttfb_ms": round(ttfb * 1000, 2) if ttfb is not None else None,
                "bytes_out": state.bytes_out,
                "tokens": tokens,
                "error": error.message if error is not None else None,
            }
            if state.tunnel is not None:
                line["websocket_bytes_in"] = state.tunnel.bytes_from_client

        stopping = state.stopping
        if stopping is None:
            self._report(state, level, line, tokens, None, exc=ending.exc)
        elif stopping.stopped:
            self._report(
                state, level, line, tokens, stopping.tokens_after_disconnect, exc=ending.exc
            )
        else:
            stopping.on_stopped = functools.partial(
                self._report, state, level, line, tokens, exc=ending.exc
            )

    def _report(
        self,
        state: RequestState,
        level: int,
        line: dict[str, object] | None,
        tokens: int,
        tokens_after_disconnect: int | None,
        *,
        exc: BaseException | None,
    ) -> None:
        """What the engine says the request used, once known: at the handler's end, or once
        tether stopped the engine's work for it (the tokens it produced after the client
        left). The span ends here."""
        relay = state.relay
        counted = relay.tokens if relay is not None else None
        prompt = counted.reported_prompt() if counted is not None else None
        engine_total = counted.reported() if counted is not None else None
        completion = (
            engine_total
            if engine_total is not None
            else tokens + (tokens_after_disconnect or 0)
            if relay is not None
            else None
        )
        # The engine counts a prompt only once its prefill made the first token (vLLM): a
        # request ended before that reports its prompt as 0, as the engine's own count does.
        if prompt is not None and completion == 0 and state.engine.prompt_counted_from_first_token:
            prompt = 0  # ended before its prefill finished: as the engine counts it
        if prompt is not None:
            self._metrics.record_prompt_tokens(state.route_label, prompt)
        span = state.span
        if span is not None:
            span.set_gen_ai(
                input_tokens=prompt,
                output_tokens=completion,
                model=state.body.model,
                finish_reasons=counted.finish_reasons() if counted is not None else (),
            )
            span.end()
        if line is None:
            return
        self._log.log(
            level,
            "request_finished",
            **line,
            prompt_tokens=prompt,
            completion_tokens=completion,
            completion_tokens_after_disconnect=tokens_after_disconnect,
            tokens_counted=(
                "engine" if engine_total is not None else "events" if relay is not None else None
            ),
            exc_info=exc,
        )
