"""SSE keep-alive (TETHER_SSE_KEEPALIVE): a stream whose engine is silent gets comment lines,
between events only, so that a load balancer that cuts idle connections keeps it; before the
engine's head the client's stream begins early, and an error then arrives as one error event.
Every client tested reads such a stream as it reads the engine's: the openai SDK, curl, and a
raw socket that checks every byte."""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from proxy.server.runner import TetherServer
from proxy.upstream.stream_keepalive import KEEPALIVE_COMMENT, StreamKeepAlive
from proxy.wire.error_events import engine_error, error_event

from .support.chat import chat_body, openai_chat_text, sse_ids
from .support.fake_transport import SteppedClockLoop, run_on_stepped_clock, settle
from .support.in_process import TetherFactory, settled
from .support.metrics import metric
from .support.nginx import nginx_binary, nginx_in_front_of
from .support.raw_http import RawClient, Reply
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory
from .test_upstream_relay import event, framed, relayed

COMMENT = KEEPALIVE_COMMENT
CLIENT_ID = "client-kept-alive"
# A keep-alive interval short enough for the tests, long enough for a loaded 2-core machine.
KEEPALIVE = 0.25


async def _stream(port: int, body: dict[str, Any], *, path: str = "/v1/chat/completions") -> Reply:
    """One request on a raw connection and its whole answer (a cut stream fails the read)."""
    client = await RawClient.connect(port)
    try:
        await client.send_request(body, path=path, headers={"X-Request-Id": CLIENT_ID})
        return await client.read_reply(timeout=15)
    finally:
        client.close_fin()


def _events(body: bytes) -> list[bytes]:
    """The blocks of an SSE body (events and comments), each without its blank line."""
    return [block for block in body.split(b"\n\n") if block]


def _text(body: bytes) -> str:
    """The completion text of a chat stream."""
    return "".join(
        choice["delta"].get("content") or ""
        for block in _events(body)
        if block.startswith(b"data: {")
        for choice in json.loads(block[len(b"data: ") :])["choices"]
    )


def _completed(server: TetherServer, status_class: str) -> float:
    registry = server.context.metrics.registry
    return metric(
        registry, "tether_requests_total", route="/v1/chat/completions", status_class=status_class
    )


# --- the Done-when: an idle-cutting nginx in front of tether -----------------------------------

# nginx's proxy_read_timeout, and the engine's silence: well over it, so a cut is certain.
NGINX_READ_TIMEOUT = 1.5
SILENCE = 2.5


def _silent_first(where: str) -> dict[str, Any]:
    """A stream of 5 tokens whose engine is silent for SILENCE before its head or after it."""
    if where == "before_head":
        return chat_body(max_tokens=5, head_after=SILENCE)
    return chat_body(max_tokens=5, prefill=SILENCE)


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed")
@pytest.mark.parametrize("where", ["before_head", "after_head"])
async def test_a_stream_silent_longer_than_nginx_allows_arrives_whole_with_keepalive(
    fake_engine: FakeEngineFactory, tether: TetherFactory, where: str
) -> None:
    """Behind an nginx that cuts a connection idle for 1.5 s, a stream whose first token comes
    after 2.5 s of silence (before the engine's head, or after it: a long prefill) reaches
    the client whole: every token, then [DONE]."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm", sse_keepalive=KEEPALIVE)
    async with nginx_in_front_of(server.port, read_timeout=NGINX_READ_TIMEOUT) as port:
        reply = await _stream(port, _silent_first(where))

    assert reply.status == 200
    assert _text(reply.body) == " tok0 tok1 tok2 tok3 tok4"
    assert _events(reply.body)[-1] == b"data: [DONE]"
    assert COMMENT in reply.body


@pytest.mark.skipif(nginx_binary() is None, reason="nginx is not installed")
@pytest.mark.parametrize("where", ["before_head", "after_head"])
async def test_without_keepalive_nginx_cuts_the_silent_stream(
    fake_engine: FakeEngineFactory, tether: TetherFactory, where: str
) -> None:
    """The same stream without TETHER_SSE_KEEPALIVE: nginx gives up on it after 1.5 s, with a
    504 before the engine's head, with a cut stream after it."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm")
    async with nginx_in_front_of(server.port, read_timeout=NGINX_READ_TIMEOUT) as port:
        client = await RawClient.connect(port)
        await client.send_request(_silent_first(where))
        if where == "before_head":
            reply = await client.read_reply(timeout=10)
            assert reply.status == 504
        else:
            with pytest.raises(asyncio.IncompleteReadError):
                await client.read_reply(timeout=10)
        client.close_fin()


# --- where comments go --------------------------------------------------------------------------


def _pausing_engine(pause: float) -> web.Application:
    """An engine that writes its first event in two halves with `pause` between them (inside
    the event), then pauses as long before the next event (between events)."""

    async def stream(request: web.Request) -> web.StreamResponse:
        prefix = b'data: {"id":"chatcmpl-' + request.headers["X-Request-Id"].encode()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(prefix + b'","choices":[{"index":0,')
        await asyncio.sleep(pause)
        await response.write(b'"delta":{"content":"a"}}]}\n\n')
        await asyncio.sleep(pause)
        await response.write(prefix + b'","choices":[{"index":0,"delta":{"content":"b"}}]}\n\n')
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    return app


async def test_comments_go_between_events_never_inside_one(
    upstream_app: UpstreamAppFactory, tether: TetherFactory
) -> None:
    """An engine silent in the middle of an event gets no comment there (the event reaches the
    client whole, as the engine wrote it); silent between two events, it gets comments."""
    server = await tether(
        await upstream_app(_pausing_engine(4 * KEEPALIVE)), engine="vllm", sse_keepalive=KEEPALIVE
    )
    reply = await _stream(server.port, chat_body())

    blocks = _events(reply.body)
    comments = [index for index, block in enumerate(blocks) if block == COMMENT.strip()]
    assert comments and min(comments) == 1  # after the first event, none before it
    assert [b for b in blocks if b != COMMENT.strip()] == [
        b'data: {"id":"chatcmpl-%b","choices":[{"index":0,"delta":{"content":"a"}}]}'
        % CLIENT_ID.encode(),
        b'data: {"id":"chatcmpl-%b","choices":[{"index":0,"delta":{"content":"b"}}]}'
        % CLIENT_ID.encode(),
        b"data: [DONE]",
    ]


@pytest.mark.socket_free
def test_no_comment_inside_an_event_and_no_timer_left() -> None:
    """On a clock the test moves: no comment while the client's stream is inside an event, one
    once the event ended and an interval passed in silence, none counted as an event; and
    stopping it leaves no timer behind."""

    async def main(loop: SteppedClockLoop) -> None:
        relay = await relayed()
        keepalive = StreamKeepAlive(relay.relay, 1.0, first_check=1.0)
        whole = event(1)
        relay.engine_sends(whole[:20])
        for _ in range(4):
            loop.advance(0.5)
            await settle()
        assert COMMENT not in relay.client.written
        relay.engine_sends(whole[20:])
        loop.advance(1.0)
        await settle()
        loop.advance(0.5)
        await settle()
        assert relay.client.written.endswith(framed(COMMENT))
        assert keepalive.comments == 1 and relay.relay.sse_events == 1
        keepalive.stop()
        assert loop.timers_waiting == 0
        relay.exchange.close()

    run_on_stepped_clock(main)


@pytest.mark.socket_free
def test_a_long_silence_gets_one_comment_per_interval() -> None:
    """However long the engine is silent, the client gets a comment every interval (not every
    half of one, when the timer looks)."""

    async def main(loop: SteppedClockLoop) -> None:
        relay = await relayed()
        keepalive = StreamKeepAlive(relay.relay, 1.0, first_check=1.0)
        for _ in range(20):  # 10 s, in steps of the timer's period
            loop.advance(0.5)
            await settle()
        assert keepalive.comments == 10
        keepalive.stop()
        relay.exchange.close()

    run_on_stepped_clock(main)


@pytest.mark.socket_free
def test_a_relay_not_to_the_client_takes_no_comment() -> None:
    """A relay reading into a buffer (a JSON answer) or discarding (the client left) never
    writes a comment."""

    async def main(loop: SteppedClockLoop) -> None:
        relay = await relayed()
        relay.relay.discard()
        assert not relay.relay.write_between_events(COMMENT)
        buffered = await relayed(to_client=False)
        assert not buffered.relay.write_between_events(COMMENT)
        assert COMMENT not in relay.client.written + buffered.client.written
        relay.exchange.close()
        buffered.exchange.close()

    run_on_stepped_clock(main)


# --- the error event -----------------------------------------------------------------------------


@pytest.mark.socket_free
@pytest.mark.parametrize(
    ("status", "body", "error"),
    [
        (  # OpenAI's shape (vLLM, llama.cpp): as it is
            400,
            b'{"error": {"message": "bad", "type": "BadRequestError", "param": null, "code": 400}}',
            {"message": "bad", "type": "BadRequestError", "param": None, "code": 400},
        ),
        (  # flat, with "object": "error" (SGLang, older vLLM): nested
            400,
            b'{"object":"error","message":"bad","type":"BadRequestError","param":null,"code":400}',
            {"message": "bad", "type": "BadRequestError", "param": None, "code": 400},
        ),
        (  # TGI's: the message kept, its type named
            422,
            b'{"error":"Input validation error","error_type":"validation"}',
            {"message": "Input validation error", "type": "validation", "code": 422},
        ),
        (  # anything else: the status named
            502,
            b"<html>Bad Gateway</html>",
            {"message": "the engine answered 502", "type": "upstream_error", "code": 502},
        ),
        (
            429,
            b'{"detail": "slow down"}',
            {"message": "the engine answered 429", "type": "invalid_request_error", "code": 429},
        ),
    ],
)
def test_an_engine_answer_becomes_one_openai_error_event(
    status: int, body: bytes, error: dict[str, Any]
) -> None:
    """The engine's error after an early commit: its own error object where it wrote one, in
    one event on one line, as OpenAI's SDKs read a stream's error."""
    written = error_event(engine_error(status, body))
    assert written.startswith(b"data: ") and written.endswith(b"\n\n")
    assert written.count(b"\n") == 2
    assert json.loads(written.removeprefix(b"data: ")) == {"error": error}


# --- the early commit ---------------------------------------------------------------------------


async def test_early_commit_then_the_engines_stream_follows_mapped_and_counted(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """The engine's head comes after several intervals: the client's 200 stream began with
    comments, then carries the engine's events with the client's own ID in each, and the
    tokens are counted as for any stream."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm", sse_keepalive=KEEPALIVE)
    reply = await _stream(server.port, chat_body(max_tokens=5, head_after=4 * KEEPALIVE))

    assert reply.status == 200
    assert reply.headers["Content-Type"] == "text/event-stream"
    assert reply.headers["X-Request-Id"] == CLIENT_ID
    assert reply.headers["Cache-Control"] == "no-cache"
    assert reply.headers["X-Accel-Buffering"] == "no"
    assert reply.body.startswith(COMMENT)
    assert set(sse_ids(reply.body.decode())) == {f"chatcmpl-{CLIENT_ID}"}
    assert _text(reply.body) == " tok0 tok1 tok2 tok3 tok4"
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_tokens_relayed_total", route="/v1/chat/completions") == 5
    assert _completed(server, "2xx") == 1


async def test_early_commit_then_an_engine_error_is_one_error_event_and_a_clean_end(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """The engine refuses the request after the client's stream began: the client gets the
    engine's error object as the stream's one event, then the stream's clean end; the request
    is reported with the engine's status, as it is without keep-alive."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm", sse_keepalive=KEEPALIVE)
    body = chat_body(head_after=4 * KEEPALIVE, answer_status=400)
    reply = await _stream(server.port, body)

    assert reply.status == 200
    blocks = _events(reply.body)
    assert set(blocks[:-1]) == {COMMENT.strip()}
    assert json.loads(blocks[-1].removeprefix(b"data: ")) == {
        "error": {
            "message": "the fake engine answers 400",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
    }
    await settled(server)
    assert _completed(server, "4xx") == 1
    assert _completed(server, "2xx") == 0


async def test_a_tether_failure_after_the_early_commit_is_one_error_event(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """tether gives up (TETHER_REQUEST_TIMEOUT) after the client's stream began: the client
    gets tether's own error as the stream's one event and a clean end, never a cut stream,
    and the engine's work is stopped."""
    engine, engine_url = await fake_engine()
    server = await tether(
        engine_url, engine="vllm", sse_keepalive=KEEPALIVE, request_timeout=4 * KEEPALIVE
    )
    reply = await _stream(server.port, chat_body(max_tokens=1000, head_after=60))

    blocks = _events(reply.body)
    assert set(blocks[:-1]) == {COMMENT.strip()}
    error = json.loads(blocks[-1].removeprefix(b"data: "))["error"]
    assert (error["type"], error["code"]) == ("timeout_error", "upstream_timeout")
    await settled(server)
    assert _completed(server, "5xx") == 1
    await engine.wait_for(lambda: engine.aborted_ids())


async def test_a_cancel_after_the_early_commit_is_one_error_event_and_a_clean_end(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Its caller cancels it by ID after the client's stream began early and before the
    engine answered: the client gets `request_cancelled` as the stream's one event and a clean
    end (never a cut stream), and the engine's work is stopped."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm", sse_keepalive=KEEPALIVE)
    client = await RawClient.connect(server.port)
    await client.send_request(
        chat_body(max_tokens=1000, head_after=60),
        headers={"X-Request-Id": "cancel-early", "Authorization": "Bearer early-key"},
    )
    await client.read_until(COMMENT)
    async with http.post(
        f"http://127.0.0.1:{server.port}/v1/requests/cancel-early/cancel",
        headers={"Authorization": "Bearer early-key"},
    ) as cancelled:
        assert cancelled.status == 200
    reply = await client.read_until(b"0\r\n\r\n", timeout=10)

    assert b'"code":"request_cancelled"' in reply.replace(b" ", b"")
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="cancelled") == 1
    await engine.wait_for(lambda: engine.aborted_ids())


# --- which requests get it -----------------------------------------------------------------------


async def test_keepalive_is_off_by_default(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """Without TETHER_SSE_KEEPALIVE a silent engine's stream gets no comment, and its error
    keeps its HTTP status."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm")
    reply = await _stream(server.port, chat_body(head_after=0.5, prefill=0.5))
    refused = await _stream(server.port, chat_body(head_after=0.5, answer_status=400))

    assert COMMENT not in reply.body and _text(reply.body)
    assert refused.status == 400 and COMMENT not in refused.body


async def test_a_skipped_path_gets_no_keepalive(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A path in TETHER_SSE_KEEPALIVE_SKIP_PATHS gets no comment, and its client sees the
    engine's error status; other paths keep theirs."""
    _, engine_url = await fake_engine()
    server = await tether(
        engine_url,
        engine="vllm",
        sse_keepalive=0.1,
        sse_keepalive_skip_paths="/v1/chat/completions",
    )
    refused = await _stream(server.port, chat_body(head_after=0.5, answer_status=400))
    kept = await _stream(
        server.port,
        {"model": "fake", "prompt": "x", "stream": True, "fake": {"prefill": 0.5}},
        path="/v1/completions",
    )

    assert refused.status == 400 and COMMENT not in refused.body
    assert COMMENT in kept.body


async def test_a_non_streaming_request_gets_no_keepalive(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A request that did not ask to stream gets its JSON answer as the engine wrote it,
    however long the engine takes."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm", sse_keepalive=0.1)
    reply = await _stream(server.port, chat_body(stream=False, token_interval=0.1))

    assert reply.status == 200 and reply.headers["Content-Type"].startswith("application/json")
    assert reply.json()["choices"][0]["message"]["content"] == " tok0 tok1 tok2 tok3 tok4"


# --- clients ------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["before_head", "after_head"])
async def test_the_openai_sdk_reads_a_kept_alive_stream_unchanged(
    fake_engine: FakeEngineFactory, tether: TetherFactory, where: str
) -> None:
    """The openai SDK reads a stream with comments where its engine was silent, before the
    engine's head or after it, into the same text as the same stream without keep-alive."""
    _, engine_url = await fake_engine()
    kept = await tether(engine_url, engine="vllm", sse_keepalive=0.1)
    plain = await tether(engine_url, engine="vllm")
    # One silence at a time: the fake engine's prefill starts when the request arrives, so one
    # no longer than the wait for its head leaves no silence after the head.
    silence: dict[str, Any] = {"head_after": 0.5} if where == "before_head" else {"prefill": 0.5}

    text = await openai_chat_text(kept.port, **silence)
    assert text == await openai_chat_text(plain.port, **silence)
    assert text == " tok0 tok1 tok2 tok3 tok4"
    # (the stream it read began with comments)
    assert _events((await _stream(kept.port, chat_body(**silence))).body)[0] == COMMENT.strip()


async def test_the_openai_sdk_raises_an_engine_error_after_the_early_commit(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """An engine error that arrives after the client's stream began is an `openai.APIError`
    carrying the engine's message."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm", sse_keepalive=0.1)

    with pytest.raises(openai.APIError, match="the fake engine answers 503") as raised:
        await openai_chat_text(server.port, head_after=0.5, answer_status=503)
    assert raised.type is openai.APIError  # raised from the stream, not from a 503 status


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("where", ["before_head", "after_head"])
async def test_curl_reads_a_kept_alive_stream_whole(
    fake_engine: FakeEngineFactory, tether: TetherFactory, where: str
) -> None:
    """`curl -sN` receives a stream with comments where its engine was silent, before the
    engine's head or after it, whole (exit status 0: no cut transfer)."""
    # One silence at a time, as for the openai SDK above.
    silence: dict[str, Any] = {"head_after": 0.5} if where == "before_head" else {"prefill": 0.5}
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="vllm", sse_keepalive=0.1)
    curl = await asyncio.create_subprocess_exec(
        "curl",
        "-sN",
        "--max-time",
        "15",
        "-H",
        "Content-Type: application/json",
        "-d",
        json.dumps(chat_body(**silence)),
        f"http://127.0.0.1:{server.port}/v1/chat/completions",
        stdout=asyncio.subprocess.PIPE,
    )
    output, _ = await asyncio.wait_for(curl.communicate(), 20)

    assert curl.returncode == 0
    assert output.startswith(COMMENT)
    assert _text(output) == " tok0 tok1 tok2 tok3 tok4"
    assert output.endswith(b"data: [DONE]\n\n")
