"""Token accounting on response bytes, as input → output tables: the shapes vLLM 0.32 and
SGLang 0.5.23 really send (compact JSON), the engine's own count where it gives one."""

from __future__ import annotations

import pytest

from proxy.engines.sglang import GENERATE_TOKENS
from proxy.wire.tokens import TokenCounter, TokenShape

pytestmark = pytest.mark.socket_free

ROLE = b'data: {"id":"chatcmpl-x","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'  # noqa: E501


def chat(content: str, reason: str | None = None) -> bytes:
    finish = f'"{reason}"' if reason else "null"
    return (
        b'data: {"id":"chatcmpl-x","object":"chat.completion.chunk","choices":[{"index":0,'
        b'"delta":{"content":"'
        + content.encode()
        + b'"},"logprobs":null,"finish_reason":'
        + finish.encode()
        + b"}]}\n\n"
    )


USAGE = b'data: {"id":"chatcmpl-x","choices":[],"usage":{"prompt_tokens":8,"total_tokens":27,"completion_tokens":19}}\n\n'  # noqa: E501
DONE = b"data: [DONE]\n\n"


def count(shape: TokenShape, *chunks: bytes) -> TokenCounter:
    counter = TokenCounter(shape)
    for chunk in chunks:
        counter.feed(chunk)
    return counter


def test_chat_stream_counts_one_token_per_delta_but_not_the_role_event() -> None:
    """vLLM's first event only names the role; the last token carries finish_reason."""
    counter = count(TokenShape.CHAT, ROLE, chat(" a"), chat(""), chat(" b", "length"), DONE)
    assert counter.events == 3  # an empty delta is a token too (a split UTF-8 character)
    assert counter.total() == 3


def test_aborted_chat_stream_does_not_count_its_abort_event() -> None:
    """After an abort vLLM sends one more event, empty, with finish_reason "abort"."""
    counter = count(TokenShape.CHAT, ROLE, chat(" a"), chat(" b"), chat("", "abort"), DONE)
    assert counter.events == 2


def test_usage_in_the_stream_is_the_engines_own_count() -> None:
    """With include_usage the final usage event's completion_tokens wins over the events."""
    counter = count(TokenShape.CHAT, ROLE, chat(" a"), chat("", "abort"), USAGE, DONE)
    assert counter.events == 1
    assert counter.reported() == 19
    assert counter.total() == 19


def test_several_events_in_one_read_and_one_event_split_across_reads() -> None:
    """Counting does not depend on how the network cut the stream."""
    stream = ROLE + chat(" a") + chat(" b") + chat(" c", "length") + USAGE + DONE
    whole = count(TokenShape.CHAT, stream)
    # 40-byte reads: far smaller than any engine writes, and every event split several times.
    cut = count(TokenShape.CHAT, *(stream[i : i + 40] for i in range(0, len(stream), 40)))
    assert whole.events == 3 and whole.reported() == 19
    # A marker cut in half is missed: the count is off by at most one event per split marker,
    # while the engine's own count, read from the end, is exact.
    assert cut.reported() == 19


@pytest.mark.parametrize(
    ("shape", "chunks", "events", "reported"),
    [
        (
            TokenShape.COMPLETION,
            [
                b'data: {"id":"cmpl-x","choices":[{"index":0,"text":" a","finish_reason":null}]}\n\n',  # noqa: E501
                b'data: {"id":"cmpl-x","choices":[{"index":0,"text":"","finish_reason":"abort"}]}\n\n',  # noqa: E501
                DONE,
            ],
            1,
            None,
        ),
        (
            TokenShape.MESSAGES,
            [
                b'event: message_start\ndata: {"type":"message_start","message":{"usage":{"input_tokens":8,"output_tokens":0}}}\n\n',  # noqa: E501
                b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta","text":" a"},"index":0}\n\n',  # noqa: E501
                b'event: content_block_delta\ndata: {"type":"content_block_delta","delta":{"type":"text_delta","text":" b"},"index":0}\n\n',  # noqa: E501
                b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":null},"usage":{"input_tokens":8,"output_tokens":2}}\n\n',  # noqa: E501
                b'event: message_stop\ndata: {"type":"message_stop"}\n\n',
            ],
            2,
            2,
        ),
        (
            TokenShape.RESPONSES,
            [
                b'event: response.created\ndata: {"response":{"id":"resp_x","usage":null},"type":"response.created"}\n\n',  # noqa: E501
                b'event: response.output_text.delta\ndata: {"delta":" a","type":"response.output_text.delta"}\n\n',  # noqa: E501
                b'event: response.completed\ndata: {"response":{"usage":{"input_tokens":8,"output_tokens":6}},"type":"response.completed"}\n\n',  # noqa: E501
            ],
            1,
            6,
        ),
        (
            GENERATE_TOKENS,
            [
                b'data: {"text":" a","meta_info":{"id":"r","completion_tokens":1}}\n\n',
                b'data: {"text":" a b","meta_info":{"id":"r","completion_tokens":2}}\n\n',
                DONE,
            ],
            2,
            2,
        ),
    ],
)
def test_each_api_shape(
    shape: TokenShape, chunks: list[bytes], events: int, reported: int | None
) -> None:
    """Completions, Anthropic messages, the Responses API and SGLang's /generate."""
    counter = count(shape, *chunks)
    assert (counter.events, counter.reported()) == (events, reported)


def test_non_streaming_answer_is_counted_from_its_usage() -> None:
    """A JSON answer holds no events; its usage says how many tokens it has."""
    body = (
        b'{"id":"chatcmpl-x","object":"chat.completion","choices":[{"index":0,"message":'
        b'{"role":"assistant","content":"hello there"},"finish_reason":"abort"}],"usage":'
        b'{"prompt_tokens":8,"total_tokens":16,"completion_tokens":8,'
        b'"prompt_tokens_details":null,"completion_tokens_details":null}}'
    )
    assert count(TokenShape.CHAT, body[:40], body[40:]).total() == 8


def test_generated_text_that_mentions_a_usage_field_is_not_taken_for_it() -> None:
    """Quotes inside generated text are escaped, so they cannot spell `"completion_tokens":`."""
    tricky = chat('say \\"completion_tokens\\": 999')
    assert count(TokenShape.CHAT, ROLE, tricky, DONE).reported() is None


def test_routes_without_tokens_count_nothing() -> None:
    """Embeddings, models and the like carry no generated tokens."""
    counter = count(TokenShape.NONE, b'{"data":[{"embedding":[0.1]}],"usage":{"prompt_tokens":3}}')
    assert (counter.events, counter.reported()) == (0, None)
