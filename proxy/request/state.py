"""One request as tether serves it: the one record its handler, the registry, the abort
tracker and the accounting read, from the moment it is registered to its last report."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Hashable
from typing import Final, Protocol

from aiohttp import web

# Imported at run time, not only for the type checker: compiled, the dataclass below reads
# its fields' annotations from this module's names when it is created.
from ..engines import EngineProfile, Route
from ..errors import TetherError
from ..observe.tracing import RequestSpan
from ..outcomes import AbortResult, Outcome, Phase
from ..upstream.exchange import UpstreamExchange
from ..upstream.relay import ResponseRelay
from .body import NOTHING_LEARNT, BodyFacts
from .engine_slots import SlotGrant
from .held_stream import HeldStream
from .websocket import ClientFrames


class Stopping(Protocol):
    """A stop of the engine's work for a request, as its report waits for it (the abort
    tracker's `StopRequest`)."""

    stopped: bool  # the engine's work has stopped (or tether gave up on it)
    tokens_after_disconnect: int | None  # once stopped
    # Called once stopped, with the tokens the engine produced after the client left.
    on_stopped: Callable[[int | None], None] | None


class Ending:
    """How the handler decided a request ended: what the accounting reports. Never changed
    once made (a plain class for the reason `RequestState` is one)."""

    __slots__ = ("error", "exc", "outcome", "status")

    def __init__(
        self,
        outcome: Outcome,
        status: int,
        error: TetherError | None = None,
        exc: BaseException | None = None,
    ) -> None:
        self.outcome: Final = outcome
        self.status: Final = status  # as the client saw it (499: it left first)
        self.error: Final = error
        self.exc: Final = exc  # a bug's exception: its traceback goes in the log


class EarlyStart:
    """A client's stream begun before the engine answered (SSE keep-alive): how it is framed,
    and the engine's status once its head came (0 before), which the request is reported
    with (its client's 200 says nothing of the engine's answer)."""

    __slots__ = ("chunked", "engine_status")

    def __init__(self, chunked: bool) -> None:
        self.chunked: Final = chunked
        self.engine_status = 0


class RequestState:
    """One in-flight request. Times are `time.monotonic()` readings, as everywhere in tether.

    A plain class rather than a dataclass: compiled, a dataclass is built by the `__init__`
    that `dataclasses` generates, which runs interpreted (some 10,000 instructions a
    request here)."""

    __slots__ = (
        "body",
        "caller",
        "client_request_id",
        "client_response",
        "connection",
        "early_start",
        "echo_id",
        "ending",
        "engine",
        "engine_session",
        "held",
        "id_in_header",
        "internal_request_id",
        "left",
        "method",
        "path",
        "phase",
        "relay",
        "replayable",
        "route",
        "route_label",
        "slots",
        "span",
        "started_at",
        "stop_result",
        "stopped_by",
        "stopping",
        "task",
        "tunnel",
        "upstream",
        "upstream_cancelled",
        "websocket",
    )

    def __init__(
        self,
        client_request_id: str,
        internal_request_id: str,
        method: str,
        path: str,
        route_label: str,
        route: Route | None,
        engine: EngineProfile,
        *,
        task: asyncio.Task[object] | None = None,
        connection: Hashable | None = None,
        id_in_header: bool = False,
        websocket: bool = False,
        replayable: bool = False,
        caller: bytes | None = None,
        engine_session: str | None = None,
    ) -> None:
        self.client_request_id = client_request_id
        self.internal_request_id = internal_request_id
        self.method = method
        self.path = path
        self.route_label = route_label  # the path as a metric label
        # Its engine route; None: read-only, outside the route table.
        self.route = route
        # The engine profile it is served with from start to end (the one in force when it
        # arrived: `engine_identity`).
        self.engine = engine
        self.task = task
        # The client connection it arrived on (for the drain: connections serving no
        # request are closed at once).
        self.connection = connection
        self.span: RequestSpan | None = None
        self.started_at = time.monotonic()
        self.phase = Phase.BODY
        self.id_in_header = id_in_header  # the client named it in the request-ID header
        self.websocket = websocket  # it asks for a WebSocket session
        # It may be sent again on a new connection when a reused one closed unanswered
        # (`EngineProfile.replayable`).
        self.replayable = replayable
        # The keyed hash of the credential it carried (`wire.callers`), never the
        # credential: only the same caller cancels or lists it. None: it carried none.
        self.caller = caller
        # The session the client named in the engine's session header (llama.cpp's
        # X-Conversation-Id): the engine runs it on after the connection closes.
        self.engine_session = engine_session
        self.body: BodyFacts = NOTHING_LEARNT  # what tether learnt from its body, once sent
        # The client's ID as the engine would have written it into its answer, where that
        # is not `client_request_id` (SGLang answers with a body `rid` over the header's).
        self.echo_id: str | None = None
        # The engine slots it holds or waits for (TETHER_ENGINE_SLOTS), once its body was
        # read.
        self.slots: SlotGrant | None = None
        self.upstream: UpstreamExchange | None = None  # its exchange with the engine
        self.relay: ResponseRelay | None = None  # where the engine's response goes
        self.client_response: web.StreamResponse | None = None  # once its head was built
        # Where `client_response` began before the engine answered (SSE keep-alive).
        self.early_start: EarlyStart | None = None
        # Its stream, once it relays one its client may resume (TETHER_RESUME_GRACE).
        self.held: HeldStream | None = None
        # The client's side of a WebSocket session, once the engine took it (the engine's
        # side is `relay`).
        self.tunnel: ClientFrames | None = None
        self.stopping: Stopping | None = None  # the abort tracker stops the engine's work
        # How stopping its engine work ended, once counted (what a canceller is told).
        self.stop_result: AbortResult | None = None
        # Resolved when it leaves the registry; made only by a canceller waiting for that.
        self.left: asyncio.Future[None] | None = None
        self.upstream_cancelled = False  # tether stopped work the engine was doing for it
        # Set when tether itself ends the request (`stop`).
        self.stopped_by: Outcome | None = None
        self.ending: Ending | None = None  # set once, by the handler

    def stop(self, reason: Outcome) -> bool:
        """End the request from outside its handler (an operator's abort, its caller's
        cancel, shutdown): exactly as a client leaving would, reported as `reason`. False when
        it is already ending."""
        if self.task is None or self.task.done():
            return False
        self.stopped_by = reason
        self.task.cancel()
        return True

    @property
    def upstream_contacted(self) -> bool:
        return self.upstream is not None

    @property
    def bytes_out(self) -> int:
        """Response body bytes that went to the client."""
        return self.relay.bytes_out if self.relay is not None else 0

    def as_json(self, now: float) -> dict[str, object]:
        return {
            "client_request_id": self.client_request_id,
            "internal_request_id": self.internal_request_id,
            "method": self.method,
            "path": self.path,
            "phase": self.phase.value,
            "age_seconds": round(now - self.started_at, 3),
            "bytes_out": self.bytes_out,
        }
