"""tether's errors: one root, branches by who caused them, and the one table from an error to
the status, OpenAI-style body and log level a client and an operator see. Every error
response tether sends, on the client port and the admin port, is built by `error_response`."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Final

from aiohttp import web


class TetherError(Exception):
    """Root of every error tether raises on purpose."""

    # tether's own timeouts: the setting whose time ran out, as the cut metrics name the
    # cause (`tether_client_cut_age_seconds{cause}`). None: not one of tether's timeouts.
    timeout_setting: str | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def status(self) -> int:
        return _kind(self).status

    @property
    def code(self) -> str:
        return _kind(self).code

    @property
    def log_level(self) -> int:
        return _kind(self).log_level

    def body(self) -> bytes:
        """The OpenAI-style JSON error body for this error."""
        kind = _kind(self)
        return json.dumps(
            {"error": {"message": self.message, "type": kind.error_type, "code": kind.code}}
        ).encode()


# --- caused by the client: answered before anything goes upstream --------------------------


class ClientRequestError(TetherError):
    """Something about the request itself: it never reaches the engine."""


class InvalidRequestIdError(ClientRequestError, ValueError):
    pass


class DuplicateRequestIdError(ClientRequestError):
    """Preserve mode: the client's ID is already in flight, and the engine keys by it."""


class OverlappingRequestIdError(ClientRequestError):
    """Preserve mode, in front of an engine that aborts by prefix: the client's ID is a prefix
    of one in flight, or one in flight is a prefix of it."""


class InvalidRequestBodyError(ClientRequestError, ValueError):
    pass


class RequestBodyTooLargeError(ClientRequestError):
    pass


class TooManyEngineRequestsError(ClientRequestError, ValueError):
    """A batch (times its samples) that would make more engine requests than tether names
    in one abort (TETHER_MAX_ENGINE_REQUESTS)."""


class RequestHeadTooLargeError(ClientRequestError):
    """The request line and headers together exceed TETHER_MAX_REQUEST_HEAD."""


class RequestBodyTooComplexError(ClientRequestError):
    """A JSON body of more strings, arrays and objects than tether walks to read it."""


class ClientBodyTimeoutError(ClientRequestError, TimeoutError):
    """The client went silent while sending its body (TETHER_CLIENT_BODY_TIMEOUT)."""

    timeout_setting = "client_body_timeout"


class TooManyUploadsError(ClientRequestError):
    """TETHER_MAX_STREAMED_UPLOADS engine connections already wait for their clients' bodies
    (or the engine's answer to a WebSocket handshake)."""


class BlockedRouteError(ClientRequestError, PermissionError):
    """An engine control route: no client may reach it through tether."""


class RouteNotAllowedError(ClientRequestError, PermissionError):
    """TETHER_ALLOWED_PATHS is set and the path is not on it."""


class MethodNotAllowedError(ClientRequestError):
    """CONNECT and TRACE: a tunnel and a request echo, never an engine's business."""


class HttpVersionNotSupportedError(ClientRequestError):
    """A request line that is neither HTTP/1.0 nor HTTP/1.1 (`HTTP/2.0`, HTTP/0.9)."""


class UnsupportedUpgradeError(ClientRequestError):
    """An `Upgrade` tether does not relay (anything but a WebSocket; h2c is ignored)."""


class RequestNotFoundError(ClientRequestError, LookupError):
    """A cancel by ID names nothing this caller has in flight: an unknown ID, another
    caller's, one already finished all get this same answer."""

    def __init__(self) -> None:
        # The ID asked is not echoed: the answer must not differ by what it names.
        super().__init__("no request of yours with this ID is in flight")


class InvalidLastEventIdError(ClientRequestError, ValueError):
    """A resume names the last event it received as something other than an event number of
    the stream."""


class EventsNoLongerHeldError(ClientRequestError):
    """A resume asks for events the stream no longer holds (past TETHER_RESUME_BUFFER)."""

    def __init__(self) -> None:
        super().__init__(
            "the events after the one named are no longer held (TETHER_RESUME_BUFFER); the "
            "stream cannot be resumed from there"
        )


class TooManyFailedCancelsError(ClientRequestError):
    """A connection's cancel calls found nothing too often: IDs are not guessed cheaply."""


# --- decided by tether's operator ------------------------------------------------------------


class StoppedByTetherError(TetherError):
    """tether ended the request itself (admin abort, shutdown) before its response started."""


class AdminAbortedError(StoppedByTetherError):
    def __init__(self, message: str = "an operator aborted this request") -> None:
        super().__init__(message)


class RequestCancelledError(StoppedByTetherError):
    def __init__(self, message: str = "the request was cancelled by its ID") -> None:
        super().__init__(message)


class ShuttingDownError(StoppedByTetherError):
    def __init__(self, message: str = "tether is shutting down; retry the request elsewhere"):
        super().__init__(message)


# --- the admin API's callers ---------------------------------------------------------------------


class AdminError(TetherError):
    """A call to the admin API that cannot be served."""


class AdminDisabledError(AdminError, PermissionError):
    def __init__(self) -> None:
        super().__init__("the admin API is disabled; set TETHER_ADMIN_TOKEN to enable it")


class InvalidAdminTokenError(AdminError, PermissionError):
    def __init__(self) -> None:
        super().__init__("send Authorization: Bearer <TETHER_ADMIN_TOKEN>")


class InvalidAdminBodyError(AdminError, ValueError):
    def __init__(
        self,
        message: str = 'send a JSON object like {"request_id": "<client or internal ID>", '
        '"scope": "local" or "fleet"}',
    ) -> None:
        super().__init__(message)


class FleetNotConfiguredError(AdminError):
    def __init__(self) -> None:
        super().__init__("no other replicas are known; set TETHER_FLEET_DNS or TETHER_FLEET_PEERS")


# --- caused by the upstream or by a limit ---------------------------------------------------


class UpstreamError(TetherError):
    """The engine failed, or did not answer in time."""


class UpstreamUnavailableError(UpstreamError, ConnectionError):
    pass


class UpstreamConnectTimeoutError(UpstreamError, TimeoutError):
    timeout_setting = "connect_timeout"


class RequestTimeoutError(UpstreamError, TimeoutError):
    """TETHER_REQUEST_TIMEOUT or (with `setting="stream_idle_timeout"`)
    TETHER_STREAM_IDLE_TIMEOUT elapsed."""

    def __init__(self, message: str, setting: str = "request_timeout") -> None:
        super().__init__(message)
        self.timeout_setting = setting


class UpstreamBrokenError(UpstreamError, ConnectionError):
    """The upstream failed after its response started: the client's stream is cut."""


class UpstreamProtocolError(UpstreamError):
    """The engine's reply is not valid HTTP/1.1: a malformed status line or header, a head
    over the limit or cut off, broken chunked framing."""


# --- tether's own bugs -------------------------------------------------------------------------


class InternalError(TetherError):
    """Anything tether did not expect: a bug. The client gets a 500, the log one error line
    with the traceback (never its local variables)."""


# --- not an error of the request, a fact about the client --------------------------------------


class ClientGoneError(ConnectionError):
    """A write to the client failed: it has left."""


# --- the one table ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ErrorKind:
    """What a client and an operator see of one kind of error."""

    status: int
    error_type: str
    code: str
    # Levels by who caused it: the client (info), the engine (warning), tether's bugs (error).
    log_level: int
    # The connection closes after the answer: tether is stopping the request or draining,
    # or what follows on it is not HTTP/1.x.
    closes_connection: bool = False
    # Retry-After: this many seconds (0: a client or gateway retries at once, elsewhere).
    retry_after: int | None = None


_INFO, _WARNING, _ERROR = logging.INFO, logging.WARNING, logging.ERROR
_INVALID = "invalid_request_error"
_PERMISSION = "permission_error"
_TIMEOUT = "timeout_error"
_UNAVAILABLE = "unavailable_error"
_UPSTREAM = "upstream_error"

ERROR_KINDS: Final[dict[type[TetherError], ErrorKind]] = {
    InvalidRequestIdError: ErrorKind(400, _INVALID, "invalid_request_id", _INFO),
    DuplicateRequestIdError: ErrorKind(409, _INVALID, "duplicate_request_id", _INFO),
    OverlappingRequestIdError: ErrorKind(409, _INVALID, "overlapping_request_id", _INFO),
    InvalidRequestBodyError: ErrorKind(400, _INVALID, "invalid_request_body", _INFO),
    RequestBodyTooLargeError: ErrorKind(413, _INVALID, "request_body_too_large", _INFO),
    TooManyEngineRequestsError: ErrorKind(400, _INVALID, "too_many_engine_requests", _INFO),
    # The connection closes, as nginx closes it after a head too large: a client that sent
    # one may send more, and each costs parsing it.
    RequestHeadTooLargeError: ErrorKind(
        431, _INVALID, "request_header_fields_too_large", _INFO, closes_connection=True
    ),
    RequestBodyTooComplexError: ErrorKind(413, _INVALID, "request_body_too_complex", _INFO),
    ClientBodyTimeoutError: ErrorKind(408, _TIMEOUT, "client_body_timeout", _INFO),
    # The slots free as others' uploads end: a retry a second later, not a storm of them.
    TooManyUploadsError: ErrorKind(503, _UNAVAILABLE, "too_many_uploads", _INFO, retry_after=1),
    BlockedRouteError: ErrorKind(403, _PERMISSION, "blocked_route", _INFO),
    RouteNotAllowedError: ErrorKind(403, _PERMISSION, "route_not_allowed", _INFO),
    MethodNotAllowedError: ErrorKind(405, _INVALID, "method_not_allowed", _INFO),
    HttpVersionNotSupportedError: ErrorKind(
        505, _INVALID, "http_version_not_supported", _INFO, closes_connection=True
    ),
    UnsupportedUpgradeError: ErrorKind(400, _INVALID, "unsupported_upgrade", _INFO),
    RequestNotFoundError: ErrorKind(404, _INVALID, "request_not_found", _INFO),
    InvalidLastEventIdError: ErrorKind(400, _INVALID, "invalid_last_event_id", _INFO),
    EventsNoLongerHeldError: ErrorKind(410, _INVALID, "events_no_longer_held", _INFO),
    # The connection closes: its next guesses need a new connection (and a new budget).
    TooManyFailedCancelsError: ErrorKind(
        429, _INVALID, "too_many_failed_cancels", _INFO, closes_connection=True
    ),
    AdminAbortedError: ErrorKind(
        503, _UNAVAILABLE, "aborted_by_operator", _INFO, closes_connection=True
    ),
    # 499 as nginx logs a client's own ending (and gRPC maps CANCELLED): no SDK retries it.
    RequestCancelledError: ErrorKind(
        499, "cancelled_error", "request_cancelled", _INFO, closes_connection=True
    ),
    ShuttingDownError: ErrorKind(
        503, _UNAVAILABLE, "shutting_down", _INFO, closes_connection=True, retry_after=0
    ),
    AdminDisabledError: ErrorKind(403, _PERMISSION, "admin_disabled", _INFO),
    InvalidAdminTokenError: ErrorKind(401, "authentication_error", "invalid_admin_token", _INFO),
    InvalidAdminBodyError: ErrorKind(400, _INVALID, "invalid_body", _INFO),
    FleetNotConfiguredError: ErrorKind(400, _INVALID, "fleet_not_configured", _INFO),
    UpstreamUnavailableError: ErrorKind(502, _UPSTREAM, "upstream_unavailable", _WARNING),
    UpstreamConnectTimeoutError: ErrorKind(504, _UPSTREAM, "upstream_connect_timeout", _WARNING),
    RequestTimeoutError: ErrorKind(504, _TIMEOUT, "upstream_timeout", _WARNING),
    UpstreamBrokenError: ErrorKind(502, _UPSTREAM, "upstream_broken", _WARNING),
    UpstreamProtocolError: ErrorKind(502, _UPSTREAM, "upstream_protocol_error", _WARNING),
    InternalError: ErrorKind(500, "internal_error", "internal_error", _ERROR),
}


def _kind(error: TetherError) -> ErrorKind:
    kind = ERROR_KINDS.get(type(error))
    assert kind is not None, f"{type(error).__name__} has no row in ERROR_KINDS"
    return kind


def error_response(
    error: TetherError, request_id_header: str | None = None, client_request_id: str | None = None
) -> web.Response:
    """The answer to a request that failed before its response started: the error's status
    and OpenAI-style body, the client's own ID where it has one that can be echoed."""
    kind = _kind(error)
    response = web.Response(status=kind.status, body=error.body(), content_type="application/json")
    if request_id_header is not None and client_request_id is not None:
        response.headers[request_id_header] = client_request_id
    if kind.retry_after is not None:
        response.headers["Retry-After"] = str(kind.retry_after)
    if kind.closes_connection:
        response.force_close()
    return response
