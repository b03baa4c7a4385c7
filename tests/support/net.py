"""Ports on loopback."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nothing listens on right now: for a process the test starts (which must
    be told its port) or as an address where no engine answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(count: int) -> list[int]:
    """`count` distinct such ports (asked one by one, the kernel may give the same twice)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()
