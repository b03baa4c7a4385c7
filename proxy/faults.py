"""Where a test may make tether fail on purpose: named points in a request's life that call
a `Faults` object when one is given (`server.app.create_app(faults=...)`); production gives
none, and each point costs one comparison with None. A seam by parameter, as Go's
`net/http` keeps test hooks: no test patches a module's globals, so every module can be
compiled."""

from __future__ import annotations

from typing import Protocol

# The response head is about to be built for the client (nothing sent yet).
RESPONSE_HEAD = "response_head"
# The engine's streamed response ended; the client's stream is about to end.
STREAM_END = "stream_end"
# The abort tracker is about to wait for the engine to end an aborted response.
ABORT_CONFIRM = "abort_confirm"


class Faults(Protocol):
    def at(self, point: str) -> None:
        """Called at `point`; raising there is the fault."""
        ...
