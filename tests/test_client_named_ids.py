"""A client that names its request in the body (vLLM's `request_id`, SGLang's `rid`) gets that
name back wherever the engine would have written it, exactly as straight to the engine; the
engine still only ever sees tether's IDs (in preserve mode: the client's, unchanged).

The fake engine keys requests by the same rules as the real ones (vLLM: the X-Request-Id
header, else the body's `request_id`; SGLang: X-Override-Rid, else the body's `rid`), so each
test asks it straight first and holds tether to that answer."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest

from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.chat import chat_body, sse_ids
from .support.in_process import TetherFactory, drained, settled, url
from .support.upstreams import FakeEngineFactory

_HEX_ID = re.compile(r"[0-9a-f]{32}")


async def answer(
    http: aiohttp.ClientSession,
    base: str,
    body: dict[str, Any],
    *,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> tuple[int, str | None, list[str]]:
    """Status, X-Request-Id header and every `id` in the answer (each event's when streamed)."""
    async with http.post(base + path, json=body, headers=headers) as response:
        text = await response.text()
        header = response.headers.get("X-Request-Id")
        if body.get("stream"):
            return response.status, header, sse_ids(text)
        return response.status, header, [json.loads(text)["id"]]


def completion_body(stream: bool) -> dict[str, Any]:
    return {"model": "fake", "prompt": "hello", "stream": stream, "max_tokens": 3}


def engine_saw(engine: FakeEngine) -> list[str]:
    """The ID each request was keyed by at the engine, in arrival order."""
    return [generation.request_id for generation in engine.generations.values()]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize(
    ("path", "make_body", "prefix"),
    [
        ("/v1/chat/completions", lambda stream: chat_body(stream, 3), "chatcmpl-"),
        ("/v1/completions", completion_body, "cmpl-"),
    ],
    ids=["chat", "completions"],
)
async def test_vllm_body_request_id_comes_back_as_vllm_answers_it(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    path: str,
    make_body: Any,
    prefix: str,
    stream: bool,
) -> None:
    """`"request_id": "client-abc"` and no header: vLLM answers `chatcmpl-client-abc` /
    `cmpl-client-abc`; so does tether (in every event), with the ID in X-Request-Id too,
    while vLLM is keyed by tether's ID."""
    engine, engine_url = await fake_engine(max_tokens=3)
    body = {**make_body(stream), "request_id": "client-abc"}
    straight = await answer(http, engine_url, body, path=path)
    server = await tether(engine_url)
    status, header, ids = await answer(http, url(server, ""), body, path=path)

    assert straight[0] == status == 200
    assert set(straight[2]) == set(ids) == {prefix + "client-abc"}
    assert header == "client-abc"
    direct, proxied = engine_saw(engine)
    assert direct == "client-abc" and _HEX_ID.fullmatch(proxied)
    assert json.loads(engine.requests[1].body)["request_id"] == proxied


async def test_vllm_header_wins_over_the_body_request_id_as_in_vllm(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Both set: vLLM 0.32 answers with the header's ID (`_base_request_id`), and so does
    tether."""
    _, engine_url = await fake_engine(max_tokens=3)
    body = {**chat_body(stream=False), "request_id": "from-body"}
    headers = {"X-Request-Id": "from-header"}
    straight = await answer(http, engine_url, body, headers=headers)
    server = await tether(engine_url)
    through = await answer(http, url(server, ""), body, headers=headers)
    assert straight[2] == through[2] == ["chatcmpl-from-header"]
    assert through[1] == "from-header"


@pytest.mark.parametrize("rid_header", [False, True], ids=["body-rid", "rid-header-mode"])
async def test_sglang_rid_comes_back_as_sglang_answers_it(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    rid_header: bool,
) -> None:
    """A client's `rid` is SGLang's response `id`; through tether too (also with
    TETHER_SGLANG_RID_HEADER, where the body is only read), and SGLang runs tether's rid.
    With an X-Request-Id beside it, SGLang still answers with the rid (it does not read the
    header): so does tether's body, while its header carries the client's header ID."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG, max_tokens=3)
    server = await tether(engine_url, engine="sglang", sglang_rid_header=rid_header)
    base = url(server, "")
    for stream in (False, True):
        body = {**chat_body(stream, 3), "rid": "mine"}
        straight = await answer(http, engine_url, body, headers={"X-Request-Id": "hdr"})
        alone = await answer(http, base, body)
        beside = await answer(http, base, body, headers={"X-Request-Id": "hdr"})
        assert set(straight[2]) == set(alone[2]) == set(beside[2]) == {"mine"}
        assert (alone[1], beside[1]) == ("mine", "hdr")
    keyed = engine_saw(engine)
    assert keyed[0] == "mine" and all(_HEX_ID.fullmatch(rid) for rid in keyed[1:3])


async def test_two_clients_with_one_body_id_stay_apart(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Two in-flight requests naming the same body `request_id` are two requests to vLLM
    (straight they would collide), each answered with the name its client chose."""
    engine, engine_url = await fake_engine(max_tokens=10, token_interval=0.005)
    server = await tether(engine_url)
    body = {**chat_body(max_tokens=10), "request_id": "same"}
    results = await asyncio.gather(*(answer(http, url(server, ""), body) for _ in "ab"))
    assert [set(ids) for _, _, ids in results] == [{"chatcmpl-same"}] * 2
    keyed = engine_saw(engine)
    assert len(set(keyed)) == 2 and all(_HEX_ID.fullmatch(rid) for rid in keyed)


async def test_the_body_id_is_the_requests_id_in_the_log_and_the_registry(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The summary line and the admin registry carry the body's ID as the client's (an
    operator finds the request by the name its client knows)."""
    engine, engine_url = await fake_engine(max_tokens=10_000, token_interval=0.01)
    server = await tether(engine_url)
    body = {**chat_body(max_tokens=10_000), "request_id": "findme"}
    async with http.post(url(server), json=body) as response:
        await response.content.readuntil(b"tok0")
        [state] = server.context.registry.find("findme")
        assert state.internal_request_id in engine.generations
    await settled(server)
    await drained(server)  # the line is written once the engine's work has stopped
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    [finished] = [line for line in lines if line.get("event") == "request_finished"]
    assert finished["client_request_id"] == "findme"
    assert finished["internal_request_id"] == state.internal_request_id


async def test_a_body_id_unfit_for_a_header_is_echoed_only_where_the_engine_would(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """vLLM takes any string as a body `request_id`; one with spaces cannot go into a header
    or the log safely, so it comes back in the body (as vLLM's) and the header gets
    tether's ID."""
    _, engine_url = await fake_engine(max_tokens=2)
    server = await tether(engine_url)
    body = {**chat_body(stream=False), "request_id": 'a "quoted" name'}
    status, header, ids = await answer(http, url(server, ""), body)
    assert status == 200 and ids == ['chatcmpl-a "quoted" name']
    assert header is not None and _HEX_ID.fullmatch(header)


async def test_preserve_mode_passes_a_body_id_unchanged_and_refuses_it_twice(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """TETHER_REQUEST_ID_MODE=preserve: the body's `request_id` reaches vLLM as the client
    sent it (and as X-Request-Id, so vLLM keys the request by it), abort included; a second
    request naming it while the first runs gets a 409 and never reaches the engine."""
    engine, engine_url = await fake_engine(max_tokens=10_000, token_interval=0.01)
    server = await tether(engine_url, request_id_mode="preserve")
    base = url(server)
    body = {**chat_body(max_tokens=10_000), "request_id": "kept"}
    async with http.post(base, json=body) as first:
        await first.content.readuntil(b"tok0")
        async with http.post(base, json=body) as second:
            assert second.status == 409
            assert (await second.json())["error"]["code"] == "duplicate_request_id"
    await engine.wait_for(lambda: engine.generation("kept").state is GenerationState.ABORTED)
    assert len(engine.requests) == 1
    assert engine.requests[0].headers["X-Request-Id"] == "kept"
    assert json.loads(engine.requests[0].body)["request_id"] == "kept"
    assert [abort.ids for abort in engine.aborts] == [("chatcmpl-kept",)]
