"""tether run in-process by the production runner (`TetherServer`, the `tether` fixture):
where it listens, and waiting until it let go of its requests and abort calls."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any, Protocol

from proxy.faults import Faults
from proxy.server.runner import TetherServer

from .chat import chat_body
from .metrics import metric
from .raw_http import RawClient
from .waiting import within

# How long a test waits for tether to let go of its requests or finish its abort calls.
SETTLE_TIMEOUT = 5.0


class TetherFactory(Protocol):
    """The `tether` fixture: tether in front of `upstream_url`, settings `overrides` on top of
    the test defaults (`tests.support.settings.make_settings`)."""

    def __call__(
        self, upstream_url: str, *, faults: Faults | None = None, **overrides: Any
    ) -> Awaitable[TetherServer]: ...


def url(server: TetherServer, path: str = "/v1/chat/completions") -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def admin_url(server: TetherServer, path: str) -> str:
    return f"http://127.0.0.1:{server.admin_port}{path}"


async def settled(server: TetherServer, timeout: float = SETTLE_TIMEOUT) -> None:
    """No request left in flight: the registry is empty and the in-flight gauge agrees."""
    await within(server.context.registry.wait_empty(), timeout, "tether's registry to empty")
    assert metric(server.context.metrics.registry, "tether_requests_in_flight") == 0


async def drained(server: TetherServer, timeout: float = SETTLE_TIMEOUT) -> None:
    """Every abort call tether started has ended (each is bounded by the abort deadline)."""
    await within(server.context.aborts.drain(), timeout, "tether's abort calls to end")


async def leave_mid_stream(
    server: TetherServer,
    *,
    close: str = "fin",
    body: dict[str, Any] | None = None,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> None:
    """Open a long stream through tether, read its first token, leave (FIN or RST), and return
    once tether has let go of the request (its abort is then handed over)."""
    client = await RawClient.connect(server.port)
    await client.send_request(body or chat_body(max_tokens=100_000), path=path, headers=headers)
    await client.read_until(b"tok0")
    client.close(close)
    await within(server.context.registry.wait_empty(), SETTLE_TIMEOUT, "tether to let go")
