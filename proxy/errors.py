"""tether's errors: one root, branches by who caused them, and the one mapping from an error
to the status, OpenAI-style body and log level a client and an operator see."""

from __future__ import annotations

import json
import logging
from typing import ClassVar


class TetherError(Exception):
    """Root of every error tether raises on purpose."""

    status: ClassVar[int] = 500
    error_type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"
    log_level: ClassVar[int] = logging.ERROR

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def body(self) -> bytes:
        """The OpenAI-style JSON error body for this error."""
        return error_body(self.message, self.error_type, self.code)


def error_body(message: str, error_type: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": error_type, "code": code}}).encode()


# --- caused by the client: answered before anything goes upstream --------------------------


class ClientRequestError(TetherError):
    status = 400
    error_type = "invalid_request_error"
    log_level = logging.INFO


class InvalidRequestIdError(ClientRequestError, ValueError):
    code = "invalid_request_id"


class DuplicateRequestIdError(ClientRequestError):
    """Preserve mode: the client's ID is already in flight, and the engine keys by it."""

    status = 409
    code = "duplicate_request_id"


class InvalidRequestBodyError(ClientRequestError, ValueError):
    code = "invalid_request_body"


class RequestBodyTooLargeError(ClientRequestError):
    status = 413
    code = "request_body_too_large"


class ClientBodyTimeoutError(ClientRequestError, TimeoutError):
    """The client went silent while sending its body (TETHER_CLIENT_BODY_TIMEOUT)."""

    status = 408
    error_type = "timeout_error"
    code = "client_body_timeout"


class BlockedRouteError(ClientRequestError, PermissionError):
    status = 403
    error_type = "permission_error"
    code = "blocked_route"


class RouteNotAllowedError(ClientRequestError, PermissionError):
    """TETHER_ALLOWED_PATHS is set and the path is not on it."""

    status = 403
    error_type = "permission_error"
    code = "route_not_allowed"


class MethodNotAllowedError(ClientRequestError):
    """CONNECT and TRACE: a tunnel and a request echo, never an engine's business."""

    status = 405
    code = "method_not_allowed"


class HttpVersionNotSupportedError(ClientRequestError):
    """A request line that is neither HTTP/1.0 nor HTTP/1.1 (`HTTP/2.0`, HTTP/0.9)."""

    status = 505
    code = "http_version_not_supported"


class UnsupportedUpgradeError(ClientRequestError):
    """An `Upgrade` tether does not relay (anything but a WebSocket; h2c is ignored)."""

    code = "unsupported_upgrade"


# --- decided by tether's operator ------------------------------------------------------------


class StoppedByTetherError(TetherError):
    """tether ended the request itself (admin abort, shutdown) before its response started."""

    status = 503
    error_type = "unavailable_error"
    log_level = logging.INFO


class AdminAbortedError(StoppedByTetherError):
    code = "aborted_by_operator"


class ShuttingDownError(StoppedByTetherError):
    code = "shutting_down"

    def __init__(self, message: str = "tether is shutting down; retry the request elsewhere"):
        super().__init__(message)


# --- caused by the upstream or by a limit ---------------------------------------------------


class UpstreamError(TetherError):
    status = 502
    error_type = "upstream_error"
    log_level = logging.WARNING


class UpstreamUnavailableError(UpstreamError, ConnectionError):
    code = "upstream_unavailable"


class UpstreamConnectTimeoutError(UpstreamError, TimeoutError):
    status = 504
    code = "upstream_connect_timeout"


class RequestTimeoutError(UpstreamError, TimeoutError):
    """TETHER_REQUEST_TIMEOUT or TETHER_STREAM_IDLE_TIMEOUT elapsed."""

    status = 504
    error_type = "timeout_error"
    code = "upstream_timeout"


class UpstreamBrokenError(UpstreamError, ConnectionError):
    """The upstream failed after its response started: the client's stream is cut."""

    code = "upstream_broken"


class UpstreamProtocolError(UpstreamError):
    """The engine's reply is not valid HTTP/1.1: a malformed status line or header, a head
    over the limit or cut off, broken chunked framing."""

    code = "upstream_protocol_error"


# --- tether's own bugs -------------------------------------------------------------------------


class InternalError(TetherError):
    """Anything tether did not expect: a bug. The client gets a 500, the log one error line
    with the traceback (never its local variables)."""


# --- not an error of the request, a fact about the client --------------------------------------


class ClientGoneError(ConnectionError):
    """A write to the client failed: it has left."""
