"""WebSocket sessions (vLLM's Realtime API, `GET /v1/realtime`): which upgrade requests tether
relays, and the client's side of a session once the engine answered 101 (the engine's
side is relayed like any response body, `ResponseRelay`).

tether reads no frame: after the handshake the client's connection and the engine's carry
each other's bytes unchanged (text, binary, ping, pong, close, any extension the two
negotiated), with TCP flow control in both directions. A session ends when either side's
connection closes. The client's closing, a reset, or TCP keepalive finding a silent client
gone cancels the handler like any request's disconnect, and tether closes the engine's
connection at once: an engine's WebSocket server (uvicorn's, under vLLM) then fails its
next `receive` as if the client itself had closed, and vLLM's session cleanup aborts the
engine request. Straight to vLLM, a client that went silent is noticed only at uvicorn's
WebSocket ping timeout (20 s and more).
"""

from __future__ import annotations

import asyncio

from aiohttp import web
from multidict import istr

from ..errors import UnsupportedUpgradeError
from ..upstream.backpressure import ReadPacer
from ..upstream.exchange import UpstreamExchange

_UPGRADE = istr("Upgrade")
_CONNECTION = istr("Connection")
# Hop-by-hop, so dropped on the way through like any; the handshake puts them back.
SWITCHING_HEADERS: dict[str, str] = {_UPGRADE: "websocket", _CONNECTION: "Upgrade"}


def websocket_asked(request: web.BaseRequest) -> bool:
    """Whether the request asks for a WebSocket; raises for an upgrade tether cannot relay.

    `h2c` is ignored, as RFC 9110 §7.8 lets a server (and uvicorn and nginx do): the request
    is answered in HTTP/1.1, which a client asking for h2c must accept. Any other protocol
    would leave the client expecting a switch that never comes, so it is refused."""
    headers = request.headers
    upgrade = headers.get(_UPGRADE)
    if upgrade is None or not _names_upgrade(headers.getall(_CONNECTION, [])):
        return False
    protocol = upgrade.strip().lower()
    if protocol == "h2c":
        return False
    if protocol != "websocket":
        raise UnsupportedUpgradeError(
            f"tether relays WebSocket upgrades only (Upgrade: websocket), not {upgrade!r}"
        )
    if request.method != "GET" or request.version != (1, 1):
        raise UnsupportedUpgradeError("a WebSocket handshake is a GET in HTTP/1.1 (RFC 6455)")
    if request.body_exists:
        raise UnsupportedUpgradeError("a WebSocket handshake has no body (RFC 6455)")
    return True


def _names_upgrade(connection_fields: list[str]) -> bool:
    return any(
        token.strip().lower() == "upgrade"
        for value in connection_fields
        for token in value.split(",")
    )


class ClientFrames:
    """The client's side of a session: aiohttp's server protocol hands each read to
    `feed_data`, as it would to its own WebSocket reader, and the bytes go to the engine as
    they came; while the engine reads slower, the client is not read. (The engine's side is
    a `ResponseRelay` into the client's socket, paced the same way.)"""

    __slots__ = ("_engine", "_pacer", "bytes_from_client")

    def __init__(self, engine: UpstreamExchange, client: asyncio.Transport) -> None:
        self._engine = engine
        # Pauses reading the client while the engine's socket buffer drains.
        self._pacer = ReadPacer(client, engine.drain)
        self.bytes_from_client = 0

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self.bytes_from_client += len(data)
        engine = self._engine
        engine.write(data)
        if engine.writing_paused:
            self._pacer.pause_until_drained()
        return False, b""

    def feed_eof(self) -> None:
        """The client's connection closed; its handler is cancelled with it, and stops the
        session."""

    def close(self) -> None:
        self._pacer.stop()
