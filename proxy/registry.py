"""The in-flight registry: every request tether is serving, by internal and by client ID."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class Progress(Protocol):
    """How far a response has got (the relay's view)."""

    @property
    def bytes_out(self) -> int: ...


class Phase(StrEnum):
    """Where a request is in its life; also the `phase` label of disconnect metrics."""

    BODY = "body"  # reading the client's body (and sending it upstream)
    WAITING = "waiting"  # body sent, waiting for the engine's response (queued, prefill)
    STREAMING = "streaming"  # relaying the response to the client


class Outcome(StrEnum):
    """How a request ended; used as-is in logs and metric labels."""

    COMPLETED = "completed"
    REJECTED = "rejected"
    CLIENT_DISCONNECTED = "client_disconnected"
    ADMIN_ABORTED = "admin_aborted"
    SHUTDOWN_ABORTED = "shutdown_aborted"
    TIMED_OUT = "timed_out"
    UPSTREAM_FAILED = "upstream_failed"
    INTERNAL_ERROR = "internal_error"


@dataclass(slots=True, eq=False)
class RequestState:
    """One in-flight request: what the admin API lists and what its summary log reports."""

    client_request_id: str
    internal_request_id: str
    method: str
    path: str
    route: str
    started_at: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.BODY
    upstream_contacted: bool = False
    bytes_out: int = 0
    sse_events: int = 0
    first_byte_at: float | None = None
    # Set when tether itself ends the request (admin abort, shutdown) before cancelling it.
    ended_by: Outcome | None = None
    task: asyncio.Task[object] | None = None
    # The client connection it arrived on (for the drain: connections serving no request
    # are closed at once).
    connection: object = None
    # What is relaying its response, once that began (for the bytes sent so far).
    relay: Progress | None = None

    def as_json(self, now: float) -> dict[str, object]:
        return {
            "client_request_id": self.client_request_id,
            "internal_request_id": self.internal_request_id,
            "method": self.method,
            "path": self.path,
            "phase": self.phase.value,
            "age_seconds": round(now - self.started_at, 3),
            "bytes_out": self.relay.bytes_out if self.relay is not None else self.bytes_out,
        }


class Registry:
    """Maps internal ID → request, and client ID → its in-flight internal IDs."""

    def __init__(self) -> None:
        self._by_internal: dict[str, RequestState] = {}
        # Client ID → its one internal ID, or the set of them when a client ID is in flight
        # more than once (rare: a set per request would cost 200 bytes each).
        self._by_client: dict[str, str | set[str]] = {}
        self._empty = asyncio.Event()
        self._empty.set()

    def add(self, state: RequestState) -> None:
        self._by_internal[state.internal_request_id] = state
        self._empty.clear()
        client, internal = state.client_request_id, state.internal_request_id
        known = self._by_client.get(client)
        if known is None:
            self._by_client[client] = internal
        elif isinstance(known, set):
            known.add(internal)
        else:
            self._by_client[client] = {known, internal}

    def remove(self, state: RequestState) -> None:
        self._by_internal.pop(state.internal_request_id, None)
        client, internal = state.client_request_id, state.internal_request_id
        known = self._by_client.get(client)
        if isinstance(known, set):
            known.discard(internal)
            if len(known) == 1:
                self._by_client[client] = known.pop()
        elif known == internal:
            del self._by_client[client]
        if not self._by_internal:
            self._empty.set()

    def rename(self, state: RequestState, client_request_id: str, internal_request_id: str) -> None:
        """Give an in-flight request the IDs its body named (read after it was added)."""
        self.remove(state)
        state.client_request_id = client_request_id
        state.internal_request_id = internal_request_id
        self.add(state)

    async def wait_empty(self) -> None:
        """Until no request is in flight."""
        await self._empty.wait()

    def find(self, request_id: str) -> list[RequestState]:
        """Every in-flight request with this client ID, or the one with this internal ID."""
        known = self._by_client.get(request_id)
        internal_ids = (known,) if isinstance(known, str) else (known or ())
        found = [self._by_internal[internal] for internal in internal_ids]
        if not found and request_id in self._by_internal:
            found.append(self._by_internal[request_id])
        return found

    def connections(self) -> set[object]:
        """The client connections with a request in flight."""
        return {state.connection for state in self._by_internal.values()}

    def __len__(self) -> int:
        return len(self._by_internal)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._by_internal.values()))
