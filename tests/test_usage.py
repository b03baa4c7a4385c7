"""Exact usage for every request: where the client did not ask a stream's usage, tether asks
the engine for it and takes the usage event out of what the client gets, so the client's
stream is the one it would have had; the engine's own prompt and completion counts reach
the `request_finished` line, the metrics and the span, for abandoned requests too."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.server.runner import TetherServer
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.chat import chat_body
from .support.in_process import TetherFactory, drained, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory


def _finished(output: str) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [event for event in events if event.get("event") == "request_finished"]


def _normalised(stream: bytes) -> bytes:
    """A stream with what differs between two runs of one request made equal: the request's
    ID and the creation time."""
    stream = re.sub(rb'"id":"[^"]*"', b'"id":"-"', stream)
    return re.sub(rb'"created":\d+', b'"created":0', stream)


async def _read(session: aiohttp.ClientSession, address: str, body: dict[str, Any]) -> bytes:
    async with session.post(address, json=body) as response:
        return await response.read()


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_stream_whose_client_did_not_ask_usage_is_what_the_engine_sends_without_it(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    path: str,
) -> None:
    """Through tether (which asks the engine for usage) and straight to the engine (not
    asked), the client's stream is the same bytes, the finishing chunk's system fingerprint
    included; the engine saw tether ask."""
    engine, engine_url = await fake_engine(max_tokens=4)
    server = await tether(engine_url)
    body = (
        chat_body(max_tokens=4)
        if path.endswith("chat/completions")
        else {"prompt": "hi", "stream": True, "max_tokens": 4}
    )
    through_tether = await _read(http, url(server, path), body)
    straight = await _read(http, engine_url + path, body)

    assert _normalised(through_tether) == _normalised(straight)
    assert b'"system_fingerprint"' in straight and b'"usage"' not in straight
    asked = json.loads(engine.requests[0].body)
    assert asked["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("continuous", [False, True])
async def test_the_clients_own_stream_options_are_kept_beside_the_usage_asked_for(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    continuous: bool,
) -> None:
    """A client's other stream options (or include_usage false) stay; tether only adds
    include_usage, and the client still gets no usage event. vLLM's
    `continuous_usage_stats` acts only with include_usage, so tether's asking turns it off:
    straight, such a client gets no usage in its chunks either (found by the transparency
    catalogue against real vLLM)."""
    engine, engine_url = await fake_engine(max_tokens=4)
    server = await tether(engine_url)
    options = {"continuous_usage_stats": continuous, "include_usage": False}
    received = await _read(
        http, url(server), {**chat_body(max_tokens=4), "stream_options": options}
    )
    asked = json.loads(engine.requests[0].body)
    assert asked["stream_options"] == {"continuous_usage_stats": False, "include_usage": True}
    assert b'"usage"' not in received


async def test_a_client_that_asked_usage_gets_the_engines_usage_event(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """What the client asked for itself is relayed as the engine sends it."""
    _, engine_url = await fake_engine(max_tokens=4)
    server = await tether(engine_url)
    body = {**chat_body(max_tokens=4), "stream_options": {"include_usage": True}}
    through_tether = await _read(http, url(server), body)
    straight = await _read(http, engine_url + "/v1/chat/completions", body)
    assert _normalised(through_tether) == _normalised(straight)
    assert b'"usage":{' in through_tether


async def test_the_request_line_carries_the_engines_usage(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A completed stream and a non-streaming answer: `request_finished` has the engine's
    prompt and completion tokens (counted `engine`), and tether_prompt_tokens_total grows."""
    _, engine_url = await fake_engine(max_tokens=5)
    server = await tether(engine_url)
    await _read(http, url(server), chat_body(max_tokens=5))
    await _read(http, url(server), chat_body(stream=False, max_tokens=5))
    await settled(server)

    lines = _finished(capsys.readouterr().out)
    assert [
        (line["prompt_tokens"], line["completion_tokens"], line["tokens_counted"]) for line in lines
    ] == [
        (3, 5, "engine"),
        (3, 5, "engine"),
    ]
    registry = server.context.metrics.registry
    assert metric(registry, "tether_prompt_tokens_total", route="/v1/chat/completions") == 6


async def _leave_after(server: TetherServer, engine: FakeEngine, tokens: int) -> None:
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100_000))
    await client.read_until(b"tok%d" % tokens)
    client.close_fin()
    await settled(server)
    await drained(server)


async def test_an_abandoned_stream_is_counted_from_the_engines_own_usage(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """The client leaves mid-stream: the abort is confirmed, the engine's aborted stream ends
    with the usage tether asked for, and `request_finished` (written once the engine
    stopped) has its exact completion tokens, those after the disconnect and the prompt's."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    await _leave_after(server, engine, 3)

    [generation] = engine.generations.values()
    assert generation.state is GenerationState.ABORTED
    [line] = _finished(capsys.readouterr().out)
    assert line["outcome"] == "client_disconnected"
    assert line["tokens_counted"] == "engine"
    assert line["completion_tokens"] == generation.produced
    assert line["prompt_tokens"] == 3
    after = line["completion_tokens_after_disconnect"]
    assert after == generation.produced - line["tokens"]
    registry = server.context.metrics.registry
    assert (
        metric(registry, "tether_tokens_after_disconnect_total", route="/v1/chat/completions")
        == after
    )


async def test_without_the_engines_usage_the_line_says_it_counted_events(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """With TETHER_ASK_FOR_USAGE=false nothing is asked: the engine sees the body as sent,
    and the line says its figures are counted events."""
    engine, engine_url = await fake_engine(max_tokens=4)
    server = await tether(engine_url, ask_for_usage=False)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=4))
    await client.read_reply()
    client.close_fin()
    await settled(server)
    assert "stream_options" not in json.loads(engine.requests[0].body)
    [line] = _finished(capsys.readouterr().out)
    assert (line["tokens_counted"], line["completion_tokens"]) == ("events", 4)
    assert "prompt_tokens" not in line  # not known: left out, as every unknown field is


async def test_an_engine_that_reports_usage_unasked_is_no_longer_asked(
    upstream_app: UpstreamAppFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An engine that puts usage in every chunk (vLLM's --enable-force-include-usage): the
    stream passes whole, and tether stops asking from then on."""

    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        usage = b'"usage":{"prompt_tokens":3,"completion_tokens":1}'
        await response.write(b'data: {"choices":[{"delta":{"content":"a"}}],' + usage + b"}\n\n")
        await response.write(b'data: {"choices":[{"finish_reason":"stop"}],' + usage + b"}\n\n")
        await response.write(b'data: {"choices":[],' + usage + b"}\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", stream)
    server = await tether(await upstream_app(app), engine="vllm")
    first = await _read(http, url(server), chat_body())
    assert first.count(b'"usage":{') == 3
    assert server.context.usage.enabled is False


@pytest.mark.parametrize(("engine_kind", "prompt_tokens"), [("vllm", 0), ("sglang", 3)])
async def test_a_prompt_left_before_its_prefill_counts_as_the_engine_counts_it(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    capsys: pytest.CaptureFixture[str],
    engine_kind: str,
    prompt_tokens: int,
) -> None:
    """The client leaves during prefill: the aborted stream's usage names the prompt's 3
    tokens and no completion. vLLM counts a prompt once its prefill made a token, SGLang every
    finished request's: the line and tether_prompt_tokens_total follow the engine."""
    route = AbortRoute.SGLANG if engine_kind == "sglang" else AbortRoute.DEV
    engine, engine_url = await fake_engine(abort_route=route)
    server = await tether(engine_url, engine=engine_kind)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100_000, prefill=30))
    await engine.wait_for(lambda: len(engine.generations) == 1)
    client.close_fin()
    [generation] = engine.generations.values()
    await engine.wait_for(lambda: generation.state is GenerationState.ABORTED)
    await settled(server)
    await drained(server)

    [line] = _finished(capsys.readouterr().out)
    assert (line["tokens_counted"], line["completion_tokens"]) == ("engine", 0)
    assert line["prompt_tokens"] == prompt_tokens
    registry = server.context.metrics.registry
    assert (
        metric(registry, "tether_prompt_tokens_total", route="/v1/chat/completions")
        == prompt_tokens
    )
