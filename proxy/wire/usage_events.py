"""Pure: take the usage event tether asked for out of an SSE stream, chunk by chunk. No I/O.

When a client did not ask a stream's usage and tether did (`stream_options.include_usage`),
the engine ends the stream with one more event, `data: {…, "choices": [], "usage": {…}}`,
after every choice's finishing event and before `data: [DONE]`. The client must get the
stream it would have got, so that event goes, and with it what asking changed: vLLM 0.32
moves its `system_fingerprint` from the finishing chunks to the usage event
(`restore_fingerprint`), so from the first finishing event on the events are held until the
usage event arrives (it follows at once) and the finishing ones get it back, as their last
member, where vLLM writes it.

Until a finishing event was seen no usage event can come, and bytes pass as they arrive,
whole events or not. From then on a read that ends inside an event is held until the event's
end arrives (an SSE client acts on whole events only), up to 64 KiB: a longer event is no
usage event and passes as it comes.

An engine that reports usage on every stream by itself (vLLM's
`--enable-force-include-usage`, which then puts usage in every chunk) shows it in a chunk with
choices and usage both: from there nothing is taken out (`engine_reports_usage`).
"""

from __future__ import annotations

_EVENT_END = b"\n\n"
_FINGERPRINT = b'"system_fingerprint":'
# A partial event longer than this is not the usage event (a few hundred bytes): passed on.
_MAX_HELD = 64 * 1024
_LONGEST_MARKER = len(b'"finish_reason": "')  # the longest marker `_first_mark` looks for


class UsageEventFilter:
    """Removes the usage event from one stream."""

    __slots__ = (
        "_carry",
        "_continuing",
        "_continuing_finishing",
        "_ending",
        "_held",
        "_pending",
        "_restore_fingerprint",
        "_spaced",
        "engine_reports_usage",
    )

    def __init__(self, *, restore_fingerprint: bool) -> None:
        self._restore_fingerprint = restore_fingerprint
        self._ending = False  # a finishing event was seen: the usage event is next
        self._held = b""  # (ending) the start of an event whose end has not arrived
        self._continuing = False  # the start of the event being read already went out
        self._carry = b""  # (continuing) the last bytes that went out: a marker may span
        self._continuing_finishing = False  # (continuing) that event is a finishing one
        # (restoring) events from the first finishing one on, each with whether it finishes
        self._pending: list[tuple[bytes, bool]] = []
        # Whether the engine writes JSON with a space after the colon (learnt from its first
        # member; vLLM and SGLang do not): only then are those spellings looked for as well.
        self._spaced: bool | None = None
        # The engine puts usage in chunks with choices: it reports it unasked, on every
        # stream; nothing is taken out.
        self.engine_reports_usage = False

    def feed(self, chunk: bytes) -> bytes:
        if self.engine_reports_usage or not chunk:
            return chunk
        out: list[bytes] = []
        if not self._ending:
            # Before any finishing event nothing is held (but a newline that may be half of an
            # event's blank line): a chunk with no marker in it (nor across its start, where
            # one may continue from the last chunk) passes as it is; only whether it ends
            # inside an event is noted.
            if self._held:
                chunk, self._held = self._held + chunk, b""
            spaced = self._spaced
            if spaced is None:  # both spellings, until a read shows which one the engine uses
                colon = chunk.find(b'":')
                after = chunk[colon + 2 : colon + 3] if colon >= 0 else b""
                spaced = after in (b"", b" ")
                if after:
                    self._spaced = spaced
            carry = self._carry if self._continuing else b""
            across = bool(carry) and _first_mark(carry + chunk[:_LONGEST_MARKER], spaced) >= 0
            if not across:
                first = _first_mark(chunk, spaced)
                if first < 0:
                    if chunk.endswith(_EVENT_END):
                        self._continuing = False
                    else:
                        self._continuing, self._carry = True, (carry + chunk)[-_LONGEST_MARKER:]
                    return chunk
                # The whole events before the one with the first marker pass as they are (at
                # saturation one read holds many of a stream's events); the rest is looked
                # at event by event.
                whole = chunk.rfind(_EVENT_END, 0, first) + len(_EVENT_END)
                if whole >= len(_EVENT_END):
                    out.append(chunk[:whole])
                    chunk = chunk[whole:]
                    self._continuing = False
        data = self._held + chunk if self._held else chunk
        self._held = b""
        last = data.rfind(_EVENT_END)
        cut = last + len(_EVENT_END) if last >= 0 else 0
        events = _events(data[:cut])
        for index, event in enumerate(events):
            carry = self._carry if self._continuing else b""
            finishing = self._continuing and self._continuing_finishing
            self._continuing, self._continuing_finishing, self._carry = False, False, b""
            self._take(event, carry, out, finishing)
            if self.engine_reports_usage:  # from here on, everything as it came
                return b"".join(out) + b"".join(events[index + 1 :]) + data[cut:]
        tail = data[cut:]
        if tail:
            if self._ending and not self._continuing and len(tail) <= _MAX_HELD:
                self._held = tail
            else:
                sent = self._carry + tail if self._continuing else tail
                finishing = self._continuing_finishing or _finishes(sent)
                self._carry = sent[-_LONGEST_MARKER:]
                self._continuing, self._continuing_finishing = True, finishing
                self._ending = self._ending or finishing
                if finishing and self._restore_fingerprint:
                    # Its last brace so far may close it: held, so that the fingerprint can
                    # still go in before it.
                    brace = tail.rfind(b"}")
                    if brace >= 0:
                        self._held, tail = tail[brace:], tail[:brace]
                elif tail.endswith(b"\n"):
                    # Perhaps the first half of its blank line: held, so that the next read
                    # shows where this event ends and the next one begins.
                    self._held, tail = b"\n", tail[:-1]
                if tail:
                    self._put(tail, out)
        return b"".join(out)

    def flush(self) -> bytes:
        """The end of the stream: whatever is still held goes out as it came."""
        out = b"".join(self._release(None)) + self._held
        self._held = b""
        return out

    def _take(self, event: bytes, carry: bytes, out: list[bytes], finishing: bool) -> None:
        """One whole event, or the end of one whose start went out already (`carry`: the
        last bytes of that start, where a marker may begin; `finishing`: that start showed
        it is a finishing event)."""
        continuation = bool(carry)
        if b'"usage":{' in event or b'"usage": {' in event:
            no_choices = b'"choices":[]' in event or b'"choices": []' in event
            if not continuation and no_choices:
                out.extend(self._release(_fingerprint_of(event)))  # and the event is dropped
                return
            if not no_choices:
                self.engine_reports_usage = True
                out.extend(self._release(None))
                out.append(event)
                return
        finishing = finishing or _finishes(carry + event if carry else event)
        if finishing:
            self._ending = True
        self._put(event, out, finishing)

    def _put(self, piece: bytes, out: list[bytes], finishing: bool = False) -> None:
        if self._restore_fingerprint and (self._pending or finishing):
            self._pending.append((piece, finishing))
        else:
            out.append(piece)

    def _release(self, fingerprint: bytes | None) -> list[bytes]:
        pending, self._pending = self._pending, []
        return [
            _with_fingerprint(piece, fingerprint) if finishing and fingerprint else piece
            for piece, finishing in pending
        ]


# These run on every chunk of a stream: each spelling written out (no loop over a tuple),
# and `find`, which costs half what `in` does on bytes (no buffer-protocol round trip).
def _first_mark(data: bytes, spaced: bool) -> int:
    """Where the first usage object or finish reason in `data` begins; -1: none. `spaced`:
    also as JSON written with a space after the colon."""
    finish = data.find(b'"finish_reason":"')
    usage = data.find(b'"usage":{')
    found = [at for at in (finish, usage) if at >= 0] if finish >= 0 or usage >= 0 else []
    if spaced:
        found += [
            at for at in (data.find(b'"finish_reason": "'), data.find(b'"usage": {')) if at >= 0
        ]
    return min(found) if found else -1


def _finishes(data: bytes) -> bool:
    return data.find(b'"finish_reason":"') >= 0 or data.find(b'"finish_reason": "') >= 0


def _events(data: bytes) -> list[bytes]:
    """Whole events (each with its blank line) of `data`, which ends with one."""
    parts = data.split(_EVENT_END)
    return [part + _EVENT_END for part in parts[:-1]]


def _fingerprint_of(usage_event: bytes) -> bytes | None:
    """The `"system_fingerprint":"…"` member of the usage event, as written, if any."""
    start = usage_event.find(_FINGERPRINT)
    if start < 0:
        return None
    value = start + len(_FINGERPRINT)
    if usage_event[value : value + 1] != b'"':
        return None
    end = value + 1
    while end < len(usage_event) and usage_event[end : end + 1] != b'"':
        end += 2 if usage_event[end : end + 1] == b"\\" else 1
    return usage_event[start : end + 1]


def _with_fingerprint(event: bytes, fingerprint: bytes) -> bytes:
    """A finishing event with the fingerprint as its object's last member."""
    close = event.rfind(b"}")
    if close < 0 or _FINGERPRINT in event:
        return event
    return event[:close] + b"," + fingerprint + event[close:]
