"""Pure token accounting on response bytes: how many tokens a response carried. No I/O.

Engines say how many tokens they generated only in `usage` (OpenAI, Anthropic and Responses
APIs), SGLang's `meta_info` or llama.cpp's `timings`, and in a stream (but llama.cpp's) only
where the client asked for it. Where they
say it, that number is used. Otherwise a stream is counted by its token-carrying events: with
vLLM's and SGLang's default stream settings each such event carries one token while the engine's
HTTP handler keeps up (byte-level tokens can make its text empty, which is why events are
counted, not characters); both merge the tokens of several steps into one event when it falls
behind, so then the count is a lower bound.

Counting runs on every chunk tether relays, so it is a handful of `bytes.count` calls per
chunk (C loops over a few hundred bytes) and no JSON parsing; the reported number is read once,
at the end, from the last bytes of the response.
"""

from __future__ import annotations

from ..engines.token_shapes import ANY_COMPLETION_COUNT, ANY_PROMPT_COUNT

# Re-exported: callers name a route's shape and its counter from one module.
from ..engines.token_shapes import TokenShape as TokenShape

# The engine's own counts are where the route's shape says (`TokenShape.completion_counts`,
# `prompt_counts`; every spelling tether knows where it says none); the last one in a
# response is its total. llama.cpp's `timings`, on the last event of every stream (usage
# asked or not) and in every answer: `predicted_n` tokens generated; the prompt's are
# `cache_n` (served from the slot's cache) plus `prompt_n` (computed).
_PROMPT_CACHED = b'"cache_n":'
_PROMPT_COMPUTED = b'"prompt_n":'
_FINISH_REASONS = (b'"finish_reason":"', b'"stop_reason":"')


class TokenCounter:
    """Counts the tokens in one response's body, chunk by chunk, as it passes."""

    __slots__ = (
        "_counted",
        "_excluded",
        "_first",
        "_last",
        "_previous",
        "_reported",
        "_reported_read",
        "_shape",
        "_third",
        "events",
    )

    def __init__(self, shape: TokenShape) -> None:
        self._shape = shape
        self._counted = shape.counted
        self._excluded = shape.excluded
        # The last three chunks seen: the engine's count sits at the very end of a JSON
        # answer and in the last events of a stream (usage, then `[DONE]`), which network
        # reads deliver in whole events or more.
        self._last = self._previous = self._third = b""
        self._first: bytes | None = None  # where a stream's opening event says the prompt's
        self.events = 0
        # `reported()`, once read from the last chunks seen (the total and the report both
        # ask for it); read again after another chunk.
        self._reported: int | None = None
        self._reported_read = False

    def feed(self, chunk: bytes) -> int:
        """Count `chunk`; return how many token-carrying events it held."""
        found = 0
        for marker in self._counted:
            found += chunk.count(marker)
        if found:
            for hint, markers in self._excluded:
                if chunk.find(hint) >= 0:  # (not `in`: see `request.body`)
                    for marker in markers:
                        found -= chunk.count(marker)
            self.events += found
        if self._first is None:
            self._first = chunk
        self._third, self._previous, self._last = self._previous, self._last, chunk
        self._reported_read = False
        return found

    def reported(self) -> int | None:
        """The engine's own token count from the last bytes seen, if it reported one."""
        if not self._reported_read:
            self._reported = _last_number(
                self._tail(), self._shape.completion_counts or ANY_COMPLETION_COUNT
            )
            self._reported_read = True
        return self._reported

    def reported_prompt(self) -> int | None:
        """The prompt's tokens, as the engine reported them (at the end, or in a stream's
        opening event), if it did."""
        tail = self._tail()
        markers = self._shape.prompt_counts or ANY_PROMPT_COUNT
        found = _last_number(tail, markers)
        if found is None and self._first is not None:
            found = _last_number(self._first, markers)
        if found is None:
            computed = _last_number(tail, (_PROMPT_COMPUTED,))
            if computed is not None:
                found = computed + (_last_number(tail, (_PROMPT_CACHED,)) or 0)
        return found

    def ended_with(self, marker: bytes) -> bool:
        """Whether the response's last bytes hold `marker` (a complete stream's last event)."""
        return self._tail().find(marker) >= 0

    def finish_reasons(self) -> tuple[str, ...]:
        """The finish reasons the response's last bytes name (`finish_reason`, Anthropic's
        `stop_reason`), each once."""
        tail = self._tail()
        found: dict[str, None] = {}
        for marker in _FINISH_REASONS:
            at = tail.find(marker)
            while at >= 0:
                start = at + len(marker)
                end = tail.find(b'"', start)
                if end < 0 or end - start > 64:
                    break
                found[tail[start:end].decode("ascii", "replace")] = None
                at = tail.find(marker, end)
        return tuple(found)

    def _tail(self) -> bytes:
        return self._third + self._previous + self._last

    def total(self) -> int:
        """Tokens in the whole response: the engine's count where given, else the events."""
        reported = self.reported()
        return reported if reported is not None else self.events


def _last_number(data: bytes, markers: tuple[bytes, ...]) -> int | None:
    """The number after the last of `markers` in `data`, if any. (Read in place, digit by
    digit: once per request on a body's last bytes, where slicing them off cost more than
    the search; once one marker is found, the others are looked for only after it.)"""
    at = -1
    length = 0
    for marker in markers:
        found = data.rfind(marker, at + 1)
        if found > at:
            at, length = found, len(marker)
    if at < 0:
        return None
    index, size = at + length, len(data)
    while index < size and data[index] == 32:
        index += 1
    start, value = index, 0
    while index < size and 48 <= data[index] <= 57:
        value = value * 10 + data[index] - 48
        index += 1
    return value if index > start else None
