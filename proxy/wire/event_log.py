"""The events of one server-sent-event stream as its client sees them, numbered, and the
latest of them held, so that a client whose connection dropped can resume where it left off.

Each event the engine sends goes to the client with an `id: <n>` line first (n = 1, 2, …):
a client that reconnects names the last event it received whole (`Last-Event-ID: <n>`, what
an EventSource sends by itself) and gets every event after it, the one in progress from its
start. Held bytes are bounded per stream and across streams (`HeldBytes`, the process's
budget): while the client reads, the latest events up to half the stream's `limit` are kept
(what may be lost in flight when a connection drops; the oldest whole events go past it), so
that while it is away what the engine sends has at least the other half.
"""

from __future__ import annotations

from collections import deque

# An event's blank line may come split over two reads: what the first ended with, what the
# second must start with to complete it.
_SPLIT_BLANK_LINES = (
    (b"\n", b"\n"),
    (b"\r\n", b"\r\n"),
    (b"\r\n\r", b"\n"),
)
_LINE_ENDS = b"\r\n"


class HeldBytes:
    """The bytes every stream of this process holds for a resume, against one budget."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0

    @property
    def exceeded(self) -> bool:
        return self.held > self.limit


class EventLog:
    """One stream's events, numbered as they go to the client, the latest held for a resume."""

    __slots__ = (
        "_budget",
        "_held",
        "_limit",
        "_open",
        "_tail",
        "dropped_through",
        "held_bytes",
        "number",
    )

    def __init__(self, limit: int, budget: HeldBytes) -> None:
        self._limit = limit
        self._budget = budget
        # Whole events held, oldest first, as (number, bytes the client got for it).
        self._held: deque[tuple[int, bytes]] = deque()
        # The event in progress: the pieces the client got of it so far (None: between
        # events); and its last bytes, for a blank line split across reads.
        self._open: list[bytes] | None = None
        self._tail = b""
        self.held_bytes = 0
        self.number = 0  # events begun
        self.dropped_through = 0  # the last event no longer held (0: none dropped)

    @property
    def over_limit(self) -> bool:
        """More is held than this stream or the process may hold (only ever true while
        nothing is dropped: a held stream whose client is away)."""
        return self.held_bytes > self._limit or self._budget.exceeded

    def feed(self, chunk: bytes, *, drop_oldest: bool = True) -> bytes:
        """What the client gets for `chunk`: the same bytes, an `id:` line opening each event.
        With `drop_oldest` (its client is there to read them) the oldest whole events go past
        half the limit (or the process's budget); without, they stay, and `over_limit` says
        when more is held than allowed."""
        pieces: list[bytes] = []
        at = 0
        size = len(chunk)
        while at < size:
            if self._open is None:
                if chunk[at] in _LINE_ENDS:
                    # A blank line between events dispatches nothing: passed on, unnumbered.
                    pieces.append(chunk[at : at + 1])
                    at += 1
                    continue
                self.number += 1
                opening = b"id: %d\n" % self.number
                self._open = [opening]
                self._tail = b""
                pieces.append(opening)
                self._take(len(opening))
            end = _event_end(chunk, at, self._tail)
            piece = chunk[at:] if end < 0 else chunk[at:end]
            self._open.append(piece)
            self._take(len(piece))
            pieces.append(piece)
            if end < 0:
                self._tail = (self._tail + piece)[-3:]
                break
            self._held.append((self.number, b"".join(self._open)))
            self._open = None
            at = end
        if drop_oldest:
            self._drop_oldest()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def since(self, last_received: int) -> bytes | None:
        """Every event after `last_received` (the one in progress from its start); None when
        some of them are no longer held."""
        if last_received < self.dropped_through:
            return None
        pieces = [event for number, event in self._held if number > last_received]
        if self._open is not None and self.number > last_received:
            pieces.extend(self._open)
        return b"".join(pieces)

    def release(self) -> None:
        """Nothing is held any more (no resume can come): the bytes go back to the budget."""
        self._budget.held -= self.held_bytes
        self.held_bytes = 0
        self._held.clear()
        self._open = None
        self.dropped_through = self.number

    def _take(self, size: int) -> None:
        self.held_bytes += size
        self._budget.held += size

    def _drop_oldest(self) -> None:
        held = self._held
        while held and (self.held_bytes > self._limit // 2 or self._budget.exceeded):
            number, event = held.popleft()
            self.held_bytes -= len(event)
            self._budget.held -= len(event)
            self.dropped_through = number


def _event_end(chunk: bytes, start: int, tail: bytes) -> int:
    """Where the event in progress ends in `chunk` (the index just past its blank line),
    looking from `start`; -1 when it does not end in it. `tail`: the event's last bytes
    before `start`."""
    if tail:
        for done, rest in _SPLIT_BLANK_LINES:
            if tail.endswith(done) and chunk.startswith(rest, start):
                return start + len(rest)
    ends = [
        at + len(mark) for mark in (b"\n\n", b"\r\n\r\n") if (at := chunk.find(mark, start)) >= 0
    ]
    return min(ends) if ends else -1
