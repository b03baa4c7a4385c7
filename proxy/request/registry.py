"""The in-flight registry: every request tether is serving, by internal and by client ID."""

from __future__ import annotations

import asyncio
from bisect import bisect_left, insort
from collections.abc import Iterator

from .state import RequestState


class Registry:
    """Maps internal ID → request, and client ID → its in-flight internal IDs; with
    `prefix_index` (preserve mode, where the engine runs clients' IDs) it also finds the
    in-flight ID that another is a prefix of, for engines that abort by prefix."""

    def __init__(self, *, prefix_index: bool = False) -> None:
        self._by_internal: dict[str, RequestState] = {}
        # The internal IDs in flight, sorted: the IDs starting with a given one are
        # neighbours there.
        self._sorted: list[str] | None = [] if prefix_index else None
        # Client ID → its one internal ID, or the set of them when a client ID is in flight
        # more than once (rare: a set per request would cost 200 bytes each).
        self._by_client: dict[str, str | set[str]] = {}
        # Whoever waits for the registry to empty (shutdown), told when it does. (Not an
        # `asyncio.Event`, set and cleared as each request comes and goes: its methods run
        # interpreted, some 1,500 instructions a request.)
        self._emptied: list[asyncio.Future[None]] = []

    def add(self, state: RequestState) -> None:
        self._by_internal[state.internal_request_id] = state
        if self._sorted is not None:
            insort(self._sorted, state.internal_request_id)
        client, internal = state.client_request_id, state.internal_request_id
        known = self._by_client.get(client)
        if known is None:
            self._by_client[client] = internal
        elif isinstance(known, set):
            known.add(internal)
        else:
            self._by_client[client] = {known, internal}

    def remove(self, state: RequestState) -> None:
        if self._unlink(state) and state.left is not None and not state.left.done():
            state.left.set_result(None)

    def _unlink(self, state: RequestState) -> bool:
        if self._by_internal.pop(state.internal_request_id, None) is None:
            return False
        if self._sorted is not None:
            del self._sorted[bisect_left(self._sorted, state.internal_request_id)]
        client, internal = state.client_request_id, state.internal_request_id
        known = self._by_client.get(client)
        if isinstance(known, set):
            known.discard(internal)
            if len(known) == 1:
                self._by_client[client] = known.pop()
        elif known == internal:
            del self._by_client[client]
        if not self._by_internal and self._emptied:
            for waiter in self._emptied:
                if not waiter.done():
                    waiter.set_result(None)
        return True

    def rename(self, state: RequestState, client_request_id: str, internal_request_id: str) -> None:
        """Give an in-flight request the IDs its body named (read after it was added)."""
        self._unlink(state)
        state.client_request_id = client_request_id
        state.internal_request_id = internal_request_id
        self.add(state)

    async def wait_empty(self) -> None:
        """Until no request is in flight."""
        if not self._by_internal:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._emptied.append(waiter)
        try:
            await waiter
        finally:
            self._emptied.remove(waiter)

    def find(self, request_id: str) -> list[RequestState]:
        """Every in-flight request with this client ID, or the one with this internal ID."""
        found = self.by_client(request_id)
        if not found and request_id in self._by_internal:
            found.append(self._by_internal[request_id])
        return found

    def by_client(self, client_request_id: str) -> list[RequestState]:
        """Every in-flight request with this client ID."""
        known = self._by_client.get(client_request_id)
        internal_ids = (known,) if isinstance(known, str) else (known or ())
        return [self._by_internal[internal] for internal in internal_ids]

    def by_internal(self, internal_request_id: str) -> RequestState | None:
        return self._by_internal.get(internal_request_id)

    def prefix_related(self, request_id: str, ignoring: str | None = None) -> str | None:
        """An in-flight internal ID other than `ignoring` that starts with `request_id` or
        that `request_id` starts with (itself included), or None; only with `prefix_index`."""
        assert self._sorted is not None, "the registry keeps no prefix index"
        ids = self._sorted
        at = bisect_left(ids, request_id)
        while at < len(ids) and ids[at].startswith(request_id):
            if ids[at] != ignoring:
                return ids[at]
            at += 1
        # An ID that is a prefix of `request_id` is one of its prefixes (at most 255: an ID
        # is at most 256 characters long).
        for end in range(1, len(request_id)):
            prefix = request_id[:end]
            if prefix != ignoring and prefix in self._by_internal:
                return prefix
        return None

    def connections(self) -> set[object]:
        """The client connections with a request in flight."""
        return {state.connection for state in self._by_internal.values()}

    def __len__(self) -> int:
        return len(self._by_internal)

    def __iter__(self) -> Iterator[RequestState]:
        return iter(list(self._by_internal.values()))
