"""Pure: a non-streaming chat answer assembled from the engine's stream of the same request, as
llama-server would have answered it (`to_json_oaicompat_chat`, b11434). No I/O.

Why: llama-server notices a non-streaming client that left only when its one-second wait for
results times out, and every result of any request restarts that second, so while another
client streams it generates the whole answer for nobody. A stream it writes token by token
notices at the next write. So tether sends such a request as a stream (usage asked) and
gives its client the answer assembled here: the same members in the same order, the message
and logprobs the events add up to, the finish reason, usage and timings of the last events.

Only what is known to assemble faithfully is sent this way (`body` decides: no tools, one
sample); an event this module does not know (a tool call's delta) makes the answer
`unfaithful`, and tether answers 502 rather than something llama-server would not have.
Events are read as they come: what is kept is the answer's own text and logprobs, not the
stream.
"""

from __future__ import annotations

import json
from typing import Any

_EVENT_END = b"\n\n"
_DATA = b"data: "
# A partial event longer than this is no chat chunk (a few hundred bytes, more with logprobs).
_MAX_EVENT = 1024 * 1024
_KNOWN_DELTA = frozenset({"role", "content", "reasoning_content"})


class AnswerAssembler:
    """Reads one chat stream's events; `answer()` is the non-streaming answer they make."""

    __slots__ = (
        "_content",
        "_finish_reason",
        "_logprobs",
        "_partial",
        "_reasoning",
        "_role",
        "_timings",
        "_top",
        "_usage",
        "done",
        "error",
        "unfaithful",
    )

    def __init__(self) -> None:
        self._partial = b""
        self._top: dict[str, Any] = {}  # id, model, system_fingerprint, created: the last seen
        self._role = "assistant"
        self._content: list[str] = []
        self._reasoning: list[str] = []
        self._logprobs: list[Any] | None = None
        self._finish_reason: str | None = None
        self._usage: Any = None
        self._timings: Any = None
        self.done = False  # `[DONE]` arrived
        self.error: dict[str, Any] | None = None  # an error event ended the stream
        self.unfaithful: str | None = None  # why the events do not make a faithful answer

    def feed(self, chunk: bytes) -> None:
        data = self._partial + chunk if self._partial else chunk
        end = data.rfind(_EVENT_END)
        if end < 0:
            self._partial = data
            if len(data) > _MAX_EVENT:
                self._partial = b""
                self.unfaithful = "an event longer than 1 MiB"
            return
        self._partial = data[end + len(_EVENT_END) :]
        for event in data[:end].split(_EVENT_END):
            for line in event.split(b"\n"):
                if line.startswith(_DATA):
                    self._take(line[len(_DATA) :])

    def _take(self, payload: bytes) -> None:
        if payload.strip() == b"[DONE]":
            self.done = True
            return
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.unfaithful = "an event that is not JSON"
            return
        if not isinstance(chunk, dict):
            self.unfaithful = "an event that is not a JSON object"
            return
        if "error" in chunk:
            self.error = chunk["error"] if isinstance(chunk["error"], dict) else {}
            return
        for name in ("id", "model", "system_fingerprint", "created"):
            if name in chunk:
                self._top[name] = chunk[name]
        if "usage" in chunk:
            self._usage = chunk["usage"]
        if "timings" in chunk:
            self._timings = chunk["timings"]
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            self.unfaithful = "an event without choices"
            return
        for choice in choices:
            self._take_choice(choice)

    def _take_choice(self, choice: Any) -> None:
        if not isinstance(choice, dict) or choice.get("index", 0) != 0:
            self.unfaithful = "a choice other than the first"
            return
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if not _KNOWN_DELTA.issuperset(delta):
                self.unfaithful = f"a delta with {sorted(set(delta) - _KNOWN_DELTA)}"
            if isinstance(delta.get("role"), str):
                self._role = delta["role"]
            if isinstance(delta.get("content"), str):
                self._content.append(delta["content"])
            if isinstance(delta.get("reasoning_content"), str):
                self._reasoning.append(delta["reasoning_content"])
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict) and isinstance(logprobs.get("content"), list):
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs["content"])
        if isinstance(choice.get("finish_reason"), str):
            self._finish_reason = choice["finish_reason"]

    def answer(self) -> tuple[int, bytes] | None:
        """The status and JSON body llama-server would have answered the non-streaming
        request with; None where the events do not make one (a stream cut short, an event
        this module does not know)."""
        if self.error is not None:
            code = self.error.get("code")
            status = code if isinstance(code, int) and 400 <= code <= 599 else 500
            return status, _dumps({"error": self.error})
        if self.unfaithful is not None or self._finish_reason is None or not self.done:
            return None
        message: dict[str, Any] = {"role": self._role, "content": "".join(self._content)}
        reasoning = "".join(self._reasoning)
        if reasoning:
            message["reasoning_content"] = reasoning
        choice: dict[str, Any] = {
            "finish_reason": self._finish_reason,
            "index": 0,
            "message": message,
        }
        if self._logprobs:
            choice["logprobs"] = {"content": self._logprobs}
        top = self._top
        answer: dict[str, Any] = {
            "choices": [choice],
            "created": top.get("created"),
            "model": top.get("model"),
            "system_fingerprint": top.get("system_fingerprint"),
            "object": "chat.completion",
            "usage": self._usage,
            "id": top.get("id"),
        }
        if self._timings is not None:
            answer["timings"] = self._timings
        return 200, _dumps(answer)


def _dumps(document: Any) -> bytes:
    """JSON as llama-server writes it: compact, non-ASCII characters as they are."""
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode()
