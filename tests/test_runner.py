"""The production runner's socket options: what makes disconnects visible at the socket."""

from __future__ import annotations

import asyncio
import socket

import pytest

from proxy.server.runner import listening_socket


async def test_accepted_connections_inherit_keepalive_and_nodelay() -> None:
    """Client sockets probe a silent peer after TETHER_TCP_KEEPALIVE_IDLE seconds (a client
    that vanished without FIN or RST is found) and send small SSE writes at once."""
    listener = listening_socket("127.0.0.1", 0, keepalive_idle=17)
    port = listener.getsockname()[1]
    loop = asyncio.get_running_loop()
    client = socket.create_connection(("127.0.0.1", port))
    try:
        accepted, _ = await loop.sock_accept(listener)
        with accepted:
            assert accepted.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 17
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
            # Unacknowledged data (a stream to a vanished client) gives up as soon.
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 32_000
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
    finally:
        client.close()
        listener.close()


def test_workers_listen_on_one_port_with_reuse_port() -> None:
    """With `reuse_port`, a second listening socket binds the port the first one holds (the
    supervisor's workers share the client port); without it, it cannot."""
    first = listening_socket("127.0.0.1", 0, keepalive_idle=30, reuse_port=True)
    port = first.getsockname()[1]
    try:
        second = listening_socket("127.0.0.1", port, keepalive_idle=30, reuse_port=True)
        second.close()
        with pytest.raises(OSError):
            listening_socket("127.0.0.1", port, keepalive_idle=30)
    finally:
        first.close()
