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
    # Where the engine's own counts of the generated tokens and of the prompt's may stand:
    # by default every spelling tether knows; an API format's shape names its own (each is
    # one search of the response's tail).
    completion_counts: tuple[bytes, ...] = ()
    prompt_counts: tuple[bytes, ...] = ()

    CHAT: ClassVar[TokenShape]  # OpenAI chat completions: one `delta` per token
    COMPLETION: ClassVar[TokenShape]  # OpenAI completions: one `text` per token
    MESSAGES: ClassVar[TokenShape]  # Anthropic messages: one `content_block_delta` per token
    RESPONSES: ClassVar[TokenShape]  # OpenAI Responses API: one `*.delta` event per token
    NONE: ClassVar[TokenShape]  # no generated tokens (embeddings, models, tokenize, ...)


# The engine's own counts: `usage.completion_tokens` (OpenAI), `usage.output_tokens`
# (Anthropic, Responses), `meta_info.completion_tokens` (SGLang); llama.cpp's `timings`
# (`predicted_n`, in every answer of every API it serves); the prompt's `prompt_tokens`
# (OpenAI, SGLang's meta_info) and `input_tokens` (Anthropic's message_start at a stream's
# start; Responses). The closing quote right before the colon keeps
# `completion_tokens_details` and escaped quotes inside generated text from matching.
COMPLETION_TOKENS = b'"completion_tokens":'
OUTPUT_TOKENS = b'"output_tokens":'
PREDICTED = b'"predicted_n":'
PROMPT_TOKENS = b'"prompt_tokens":'
INPUT_TOKENS = b'"input_tokens":'
ANY_COMPLETION_COUNT = (COMPLETION_TOKENS, OUTPUT_TOKENS, PREDICTED)
ANY_PROMPT_COUNT = (PROMPT_TOKENS, INPUT_TOKENS)
# (OpenAI's formats, and Anthropic's and the Responses API's)
_OPENAI_COMPLETION, _OPENAI_PROMPT = (COMPLETION_TOKENS, PREDICTED), (PROMPT_TOKENS,)
_ANTHROPIC_COMPLETION, _ANTHROPIC_PROMPT = (OUTPUT_TOKENS, PREDICTED), (INPUT_TOKENS,)


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
    _OPENAI_COMPLETION,
    _OPENAI_PROMPT,
)
TokenShape.COMPLETION = TokenShape(
    "completion", (b'"text":',), (_ABORT_FINISH,), _OPENAI_COMPLETION, _OPENAI_PROMPT
)
TokenShape.MESSAGES = TokenShape(
    "messages",
    _spellings(b"type", b'"content_block_delta"'),
    (),
    _ANTHROPIC_COMPLETION,
    _ANTHROPIC_PROMPT,
)
TokenShape.RESPONSES = TokenShape(
    "responses",
    (
        *_spellings(b"type", b'"response.output_text.delta"'),
        *_spellings(b"type", b'"response.reasoning_text.delta"'),
    ),
    (),
    _ANTHROPIC_COMPLETION,
    _ANTHROPIC_PROMPT,
)
TokenShape.NONE = TokenShape("none")
