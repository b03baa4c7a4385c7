"""How each route's responses carry tokens: the byte markers the token counter looks for
(`proxy.wire.tokens`). Data, read once per response; no I/O.

Kept apart from the counter, which is compiled with the rest of the data plane
(`proxy.compiled`): mypyc's dataclasses would take the `ClassVar` declarations below for
fields (mypyc/mypyc#1122), so this module stays pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True, slots=True)
class TokenShape:
    """How a route's responses carry tokens: byte markers of its token-carrying events. Each
    `counted` occurrence is one event, each `excluded` occurrence one event that matched
    `counted` but carries no token. `excluded` markers are only counted in chunks holding
    their `hint` (one scan instead of one per spelling; the events they mark are rare).

    The API formats several engines serve are below; an engine's own format is defined in
    its module of `proxy.engines`."""

    name: str
    counted: tuple[bytes, ...] = ()
    excluded: tuple[tuple[bytes, tuple[bytes, ...]], ...] = ()

    CHAT: ClassVar[TokenShape]  # OpenAI chat completions: one `delta` per token
    COMPLETION: ClassVar[TokenShape]  # OpenAI completions: one `text` per token
    MESSAGES: ClassVar[TokenShape]  # Anthropic messages: one `content_block_delta` per token
    RESPONSES: ClassVar[TokenShape]  # OpenAI Responses API: one `*.delta` event per token
    NONE: ClassVar[TokenShape]  # no generated tokens (embeddings, models, tokenize, ...)


def _spellings(key: bytes, value: bytes) -> tuple[bytes, bytes]:
    """`"key":value` as compact JSON (vLLM, SGLang) and as Python's default `json.dumps`."""
    return (b'"' + key + b'":' + value, b'"' + key + b'": ' + value)


# An aborted stream ends with one more event that names the abort and carries no token.
_ABORT_FINISH = (b'"abort"', _spellings(b"finish_reason", b'"abort"'))
# The first chat event only announces the assistant's role.
TokenShape.CHAT = TokenShape(
    "chat",
    (b'"delta":',),
    ((b'"assistant"', _spellings(b"role", b'"assistant"')), _ABORT_FINISH),
)
TokenShape.COMPLETION = TokenShape("completion", (b'"text":',), (_ABORT_FINISH,))
TokenShape.MESSAGES = TokenShape("messages", _spellings(b"type", b'"content_block_delta"'))
TokenShape.RESPONSES = TokenShape(
    "responses",
    (
        *_spellings(b"type", b'"response.output_text.delta"'),
        *_spellings(b"type", b'"response.reasoning_text.delta"'),
    ),
)
TokenShape.NONE = TokenShape("none")
