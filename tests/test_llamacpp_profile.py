"""tether in front of llama.cpp's server (the fake engine playing it, `AbortRoute.LLAMACPP`):
identified as `llamacpp`, its control routes refused, every stream and answer counted from
its own `timings`, the ID it mints replaced by the client's, and a conversation stream
(`X-Conversation-Id`) whose client left stopped with `DELETE /v1/stream?conv_id=`."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from proxy.engines import Engine
from proxy.engines.identify import PROBE_PATHS, identify
from proxy.server.runner import TetherServer
from proxy.wire.ids import MintedIdMapper
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.chat import chat_body, sse_ids
from .support.in_process import TetherFactory, drained, settled, url
from .support.metrics import metric
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory
from .support.waiting import within

CONVERSATION = "X-Conversation-Id"


def _finished(output: str) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    return [event for event in events if event.get("event") == "request_finished"]


async def _llamacpp(
    fake_engine: FakeEngineFactory, tether: TetherFactory, **settings: Any
) -> tuple[FakeEngine, str, TetherServer]:
    engine, engine_url = await fake_engine(abort_route=AbortRoute.LLAMACPP, hears_disconnects=True)
    server = await tether(engine_url, engine=Engine.LLAMACPP, **settings)
    return engine, engine_url, server


async def test_llama_server_is_identified_as_llamacpp_with_its_build(
    fake_engine: FakeEngineFactory, http: aiohttp.ClientSession
) -> None:
    """Its `/props` names it: the `llamacpp` profile, the build as its version."""
    _, engine_url = await fake_engine(abort_route=AbortRoute.LLAMACPP)
    answers: dict[str, Any] = {}
    for path in PROBE_PATHS:
        async with http.get(engine_url + path) as response:
            if response.status == 200:
                answers[path] = await response.json()
    found = identify(answers)
    assert found is not None
    assert (found.product, found.profile, found.version) == ("llamacpp", "llamacpp", "b11434-fake")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/slots"),
        ("POST", "/slots/0?action=erase"),
        ("POST", "/lora-adapters"),
        ("POST", "/props"),
        ("GET", "/props"),
        ("POST", "/v1/chat/completions/control"),
        ("POST", "/models/load"),
        ("POST", "/models/unload"),
        ("POST", "/tools"),
        ("GET", "/cors-proxy"),
    ],
)
async def test_llamacpp_control_routes_are_refused_in_front_of_every_engine(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    method: str,
    path: str,
) -> None:
    """Routes that change llama-server for every client (or show every client's work) are
    refused with 403, with the llamacpp profile and with vLLM's alike."""
    _, engine_url, server = await _llamacpp(fake_engine, tether)
    other = await tether(engine_url, engine=Engine.VLLM)
    for front in (server, other):
        async with http.request(method, url(front, path), json={}) as response:
            assert response.status == 403, (front.settings.engine, path)
            assert (await response.json())["error"]["code"] == "blocked_route"


async def test_the_conversation_routes_and_chat_pass(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Its public routes stay open: chat, and the conversation stop a client may call."""
    _, _, server = await _llamacpp(fake_engine, tether)
    async with http.delete(url(server, "/v1/stream?conv_id=mine")) as response:
        assert response.status == 204
    async with http.post(url(server), json=chat_body(stream=False)) as response:
        assert response.status == 200


@pytest.mark.parametrize("stream", [True, False])
async def test_the_id_llama_server_mints_is_replaced_by_the_clients(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    stream: bool,
) -> None:
    """llama-server ignores X-Request-Id and answers `chatcmpl-<random>`: through tether
    every chunk (or the answer) carries `chatcmpl-<client id>`, as vLLM's would."""
    _, engine_url, server = await _llamacpp(fake_engine, tether)
    headers = {"X-Request-Id": "client-7"}
    async with http.post(engine_url + "/v1/chat/completions", json=chat_body(stream=stream)) as r:
        straight = await r.text()
    async with http.post(url(server), json=chat_body(stream=stream), headers=headers) as r:
        through = await r.text()
        assert r.headers["X-Request-Id"] == "client-7"
    minted = sse_ids(straight) if stream else [json.loads(straight)["id"]]
    assert all(i.startswith("chatcmpl-") and len(i) == 41 for i in minted)
    ids = sse_ids(through) if stream else [json.loads(through)["id"]]
    assert ids and set(ids) == {"chatcmpl-client-7"}


async def test_duplicate_client_ids_stay_apart_and_no_id_gets_a_unique_one(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Two requests naming the same ID each get their own whole answer under it; requests
    naming none each get tether's unique ID (never an engine ID that could collide)."""
    _, _, server = await _llamacpp(fake_engine, tether)
    texts = []
    for headers in ({"X-Request-Id": "same"}, {"X-Request-Id": "same"}, {}, {}):
        async with http.post(url(server), json=chat_body(max_tokens=3), headers=headers) as r:
            texts.append((await r.text(), r.headers["X-Request-Id"]))
    for text, echoed in texts:
        events = [line for line in text.splitlines() if line.startswith("data: {")]
        assert len(events) == 4  # the role event and 3 tokens: nothing mixed in
        assert set(sse_ids(text)) == {f"chatcmpl-{echoed}"}
    assert texts[0][1] == texts[1][1] == "same"
    assert texts[2][1] != texts[3][1]


@pytest.mark.parametrize("stream", [True, False])
async def test_every_answer_is_counted_from_llama_servers_timings(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
    stream: bool,
) -> None:
    """A stream that did not ask usage is counted from its last event's `timings` (nothing
    asked upstream, the client's stream untouched), an answer from its usage: `engine`."""
    engine, _, server = await _llamacpp(fake_engine, tether)
    async with http.post(url(server), json=chat_body(stream=stream, max_tokens=4)) as r:
        through = await r.read()
    await settled(server)
    if stream:
        assert "stream_options" not in json.loads(engine.requests[0].body)
    [line] = _finished(capsys.readouterr().out)
    assert (line["tokens_counted"], line["completion_tokens"]) == ("engine", 4)
    assert line["prompt_tokens"] == 3
    assert b'"timings"' in through


async def test_a_non_streaming_answer_is_assembled_from_a_stream(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A non-streaming chat request goes to llama-server as a stream (usage asked), so that
    it notices a client that left at its next token; the client gets the answer the events
    make: a JSON `chat.completion` with the message, finish reason and usage llama-server's
    own answer has, under `chatcmpl-<client id>`."""
    engine, engine_url, server = await _llamacpp(fake_engine, tether)
    body = chat_body(stream=False, max_tokens=4)
    async with http.post(engine_url + "/v1/chat/completions", json=body) as response:
        straight = await response.json()
    async with http.post(url(server), json=body, headers={"X-Request-Id": "whole"}) as response:
        assert response.content_type == "application/json"
        through = await response.json()
    sent = json.loads(engine.requests[-1].body)
    assert (sent["stream"], sent["stream_options"]) == (True, {"include_usage": True})
    assert through["object"] == "chat.completion"
    assert through["id"] == "chatcmpl-whole"
    for key in ("message", "finish_reason"):
        assert through["choices"][0][key] == straight["choices"][0][key]
    assert through["usage"] == straight["usage"]
    assert through["timings"]["predicted_n"] == 4


async def test_a_request_with_tools_is_not_assembled(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A non-streaming request tether cannot assemble faithfully (tools: their calls' IDs are
    drawn anew) goes as it came."""
    engine, _, server = await _llamacpp(fake_engine, tether)
    body = {**chat_body(stream=False, max_tokens=2), "tools": [{"type": "function"}]}
    async with http.post(url(server), json=body) as response:
        assert response.status == 200
    assert json.loads(engine.requests[-1].body)["stream"] is False


async def test_an_abandoned_stream_is_counted_to_the_engines_last_token(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """A client that leaves mid-stream: llama-server stops at its next write; tether counts
    what it generated, from its events, with nothing added by tether."""
    engine, _, server = await _llamacpp(fake_engine, tether)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100_000, token_interval=0.02))
    await client.read_until(b"tok2")
    client.close_fin()
    await settled(server)
    [generation] = engine.generations.values()
    await engine.wait_for(lambda: generation.state is not GenerationState.RUNNING)
    assert engine.aborts == []  # no call: the closed connection is its stop
    [line] = _finished(capsys.readouterr().out)
    assert line["outcome"] == "client_disconnected"
    assert line["completion_tokens"] >= 3


async def _open_conversation(server: TetherServer, conversation: str) -> RawClient:
    client = await RawClient.connect(server.port)
    await client.send_request(
        chat_body(max_tokens=100_000, token_interval=0.01), headers={CONVERSATION: conversation}
    )
    await client.read_until(b"tok1")
    return client


async def test_a_conversation_stream_whose_client_left_is_stopped_with_delete(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama-server runs a conversation stream on after its client leaves: tether sends
    `DELETE /v1/stream?conv_id=<id>` with the client's conversation ID unchanged, and
    confirms the stop from the stream's end."""
    engine, _, server = await _llamacpp(fake_engine, tether)
    client = await _open_conversation(server, "conv/1 a")
    client.close_fin()
    await settled(server)
    await drained(server)
    [generation] = engine.generations.values()
    assert generation.conversation == "conv/1 a"
    assert generation.state is GenerationState.ABORTED and generation.stopped_by == "abort"
    assert [(a.path, a.ids, a.status) for a in engine.aborts] == [
        ("/v1/stream", ("conv/1 a",), 204)
    ]
    registry = server.context.metrics.registry
    assert metric(registry, "tether_aborts_total", engine="llamacpp", result="confirmed") == 1


async def test_without_tether_a_conversation_stream_runs_on_after_its_client(
    fake_engine: FakeEngineFactory,
) -> None:
    """The fake engine plays llama-server's detached conversation: straight, a client that
    leaves leaves it running (what the test above relies on)."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.LLAMACPP, hears_disconnects=True)
    port = int(engine_url.rpartition(":")[2])
    client = await RawClient.connect(port)
    await client.send_request(
        chat_body(max_tokens=100_000, token_interval=0.01), headers={CONVERSATION: "c"}
    )
    await client.read_until(b"tok1")
    client.close_fin()
    [generation] = engine.generations.values()
    await engine.wait_for(lambda: len(engine.disconnects) == 1)
    produced = generation.produced
    await engine.wait_for(lambda: generation.produced > produced + 3)
    assert generation.state is GenerationState.RUNNING
    generation.end(GenerationState.ABORTED)


async def test_a_conversation_stream_cut_by_a_second_post_is_reported_cut(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """A second POST with the same conversation ID ends the first stream's body cleanly,
    with no `[DONE]`: tether cuts that client's stream too (it cannot pass for complete) and
    reports it `upstream_failed`, never `completed`."""
    _, _, server = await _llamacpp(fake_engine, tether)
    first = await _open_conversation(server, "shared")
    second = await _open_conversation(server, "shared")
    rest = await first.read_until_cut()
    assert b"[DONE]" not in rest
    second.close_fin()
    await settled(server)
    await drained(server)
    lines = _finished(capsys.readouterr().out)
    outcomes = sorted(line["outcome"] for line in lines)
    assert outcomes == ["client_disconnected", "upstream_failed"]
    cut = next(line for line in lines if line["outcome"] == "upstream_failed")
    assert "took the session over" in cut["error"]


async def test_a_conversation_stream_read_to_its_end_completes(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A conversation stream that ends with `[DONE]` is complete, and nothing is stopped."""
    engine, _, server = await _llamacpp(fake_engine, tether)
    async with http.post(
        url(server), json=chat_body(max_tokens=3), headers={CONVERSATION: "whole"}
    ) as response:
        assert (await response.read()).endswith(b"data: [DONE]\n\n")
    await within(settled(server), 5, "tether to settle")
    assert engine.aborts == []


def test_a_stream_without_a_minted_id_passes_at_once() -> None:
    """The minted ID is learnt from a stream's first event; a stream whose first event has
    none (a Responses conversation replayed) passes as it comes, never held back."""
    mapper = MintedIdMapper("chatcmpl-", b"mine")
    first = b'event: response.created\ndata: {"id":"resp_abc"}\n\n'
    assert mapper.feed(first) == first
    assert mapper.feed(b'data: {"id":"chatcmpl-zz"}\n\n') == b'data: {"id":"chatcmpl-zz"}\n\n'
