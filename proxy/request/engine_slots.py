"""The engine's slots, counted by tether: generation requests beyond them wait here, in
arrival order, instead of in the engine's own queue.

Why: llama-server notices that a queued request's client left only when its HTTP thread's
one-second wait for a result times out, and any other request's result restarts that wait;
so while other clients stream, a request whose client left is never noticed in its queue,
and runs once a slot frees (docs/engines.md, llama.cpp). Waiting in tether, the same request
is dropped the moment its client leaves and never reaches the engine. A request that waits
here would have waited as long in the engine's queue: the order is the same, and a slot is
handed on as soon as tether has relayed the end of the request that held it.

One request takes as many slots as the engine runs tasks for it (prompts times `n`), at most
all of them. A grant is recorded on the `SlotGrant` at the moment it is made, so a waiter
cancelled just after being granted still gives its slots back through `give_back`.
"""

from __future__ import annotations

import asyncio
from collections import deque

from ..observe.metrics import Gauge


class SlotGrant:
    """One request's claim: the slots it asked for, and those it holds."""

    __slots__ = ("held", "wanted")

    def __init__(self, wanted: int) -> None:
        self.wanted = wanted
        self.held = 0


class EngineSlots:
    """A first-come, first-served count of the engine's slots; `size` None: not counted
    (every request goes straight on)."""

    def __init__(self, queue: Gauge, slots: Gauge) -> None:
        self.size: int | None = None
        self._free = 0
        self._waiting: deque[tuple[SlotGrant, asyncio.Future[None]]] = deque()
        self._queue = queue  # requests waiting (`tether_engine_queue`)
        self._slots = slots  # the size, 0 when not counting (`tether_engine_slots`)

    @property
    def busy(self) -> int:
        """Slots held by requests tether sent on."""
        return 0 if self.size is None else self.size - self._free

    def resize(self, size: int | None) -> None:
        """The engine now has `size` slots (it restarted with another `-np`, or was identified
        at last); None: stop counting, and let every waiting request go on."""
        if size == self.size:
            return
        self._slots.value = size or 0
        if size is None:
            self.size = None
            self._free = 0
            while self._waiting:
                _, woken = self._waiting.popleft()
                if not woken.cancelled():
                    woken.set_result(None)  # (no slots held: none are counted any more)
            self._queue.value = 0
            return
        # Requests in flight keep what they hold; the difference frees or owes slots.
        busy = self.busy
        self.size = size
        self._free = size - busy
        self._grant()

    async def take(self, grant: SlotGrant) -> None:
        """Return once `grant` holds its slots (at once when they are free and nobody waits
        before it); cancelled, it leaves the queue."""
        size = self.size
        if size is None:
            return
        wanted = min(grant.wanted, size)
        if not self._waiting and self._free >= wanted:
            self._free -= wanted
            grant.held = wanted
            return
        woken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (grant, woken)
        self._waiting.append(entry)
        self._queue.value = len(self._waiting)
        try:
            await woken
        except asyncio.CancelledError:
            # Cancelled while waiting (its future cancelled with it), not after the grant.
            if woken.cancelled():
                if entry in self._waiting:  # (else a grant or a resize passed it over)
                    self._waiting.remove(entry)
                if self.size is not None:
                    self._grant()  # (it may have been the one the next waiters queued behind)
                self._queue.value = len(self._waiting)
            raise

    def give_back(self, grant: SlotGrant) -> None:
        """The request holding `grant` ended: its slots go to whoever waits first."""
        held, grant.held = grant.held, 0
        size = self.size
        if held and size is not None:
            # (at most all of them: slots held before a resize may be more than it left)
            self._free = min(size, self._free + held)
            self._grant()

    def _grant(self) -> None:
        size = self.size
        assert size is not None
        while self._waiting:
            grant, woken = self._waiting[0]
            if woken.cancelled():  # (its request was cancelled, not yet run: it has left)
                self._waiting.popleft()
                continue
            wanted = min(grant.wanted, size)
            if wanted > self._free:
                break
            self._waiting.popleft()
            self._free -= wanted
            grant.held = wanted
            woken.set_result(None)
        self._queue.value = len(self._waiting)
