"""Why a client's connection was cut: what the socket said when it was lost, kept for as long
as the connection's request is being handled, so that the request's report can name it.

aiohttp's server learns of a lost connection first (`connection_lost(exc)`: None for a FIN,
the socket's error otherwise) and only then cancels the request's handler, so by the time
the handler sees the client gone the cause is recorded here. A cut tether noticed before the
socket said anything (its own write found the socket closing) has no record: `write_failed`.
"""

from __future__ import annotations

from collections.abc import Hashable
from enum import StrEnum


class CutCause(StrEnum):
    """How a client's connection ended before its answer did: the `cause` label of the cut
    metrics. tether's own timeouts are named by their setting instead
    (`TetherError.timeout_setting`: `request_timeout`, `stream_idle_timeout`, ...)."""

    CLIENT_CLOSED = "client_closed"  # FIN: the client (or something in front) closed it
    CLIENT_RESET = "client_reset"  # RST, or a write into a connection the peer had reset
    KEEPALIVE_TIMEOUT = "keepalive_timeout"  # TCP keepalive probes (or TCP_USER_TIMEOUT) failed
    WRITE_FAILED = "write_failed"  # tether's write found it closing before the socket said why
    CONNECTION_ERROR = "connection_error"  # any other socket error (unreachable, ...)


# Cuts whose age says something about what sits between the client and tether: a FIN or RST
# at the same age time after time is an intermediary's idle timeout. tether's own timeouts
# (and keepalive, which runs on tether's own settings) cluster by design: they are not.
FROM_OUTSIDE = frozenset({CutCause.CLIENT_CLOSED, CutCause.CLIENT_RESET, CutCause.WRITE_FAILED})


def cause_of_loss(exc: BaseException | None) -> CutCause:
    """The cause of a lost connection from what the event loop passed to `connection_lost`
    (asyncio and uvloop alike: None after a FIN, ConnectionResetError after an RST)."""
    if exc is None:
        return CutCause.CLIENT_CLOSED
    if isinstance(exc, (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)):
        return CutCause.CLIENT_RESET
    if isinstance(exc, TimeoutError):  # ETIMEDOUT: the keepalive probes went unanswered
        return CutCause.KEEPALIVE_TIMEOUT
    return CutCause.CONNECTION_ERROR


class LostConnections:
    """The cause of each client connection lost while its request was still being handled,
    from the loss to the end of that handling (the server's `forget`): never longer."""

    __slots__ = ("_causes",)

    def __init__(self) -> None:
        self._causes: dict[Hashable, CutCause] = {}

    def lost(self, connection: Hashable, exc: BaseException | None) -> None:
        self._causes[connection] = cause_of_loss(exc)

    def forget(self, connection: Hashable) -> None:
        self._causes.pop(connection, None)

    def cause(self, connection: Hashable | None) -> CutCause:
        """Why `connection` was cut, as far as tether knows now."""
        if connection is None:
            return CutCause.WRITE_FAILED
        return self._causes.get(connection, CutCause.WRITE_FAILED)

    def __len__(self) -> int:
        return len(self._causes)
