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


@pytest.mark.parametrize(
    "body_id",
    ['a "quoted" name', "x" * 257, "x" * 4_000_000],
    ids=["spaces", "257-characters", "4-MB"],
)
@pytest.mark.parametrize(
    ("engine", "options", "field", "header"),
    [
        ("vllm", {}, "request_id", None),
        ("vllm", {}, "request_id", "from-header"),
        ("vllm", {"request_id_mode": "preserve"}, "request_id", None),
        ("sglang", {}, "rid", None),
        ("sglang", {}, "rid", "from-header"),
        ("sglang", {"sglang_rid_header": True}, "rid", "from-header"),
    ],
    ids=["vllm", "vllm-header-wins", "vllm-preserve", "sglang", "sglang-body-wins", "rid-header"],
)
async def test_a_body_id_unfit_for_a_header_is_refused_in_every_profile_and_precedence(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    engine: str,
    options: dict[str, Any],
    field: str,
    header: str | None,
    body_id: str,
) -> None:
    """A body ID obeys the header ID's rules (visible ASCII, at most 256 characters)
    whichever ID wins: the engine writes it into every event of a stream, so a long one
    would multiply the answer (a 4 MB `request_id` and 100 tokens made 424 MB on vLLM 0.32).
    It gets a 400 naming the field, small whatever the ID's size, and the engine never sees
    the request."""
    abort_route = AbortRoute.SGLANG if engine == "sglang" else AbortRoute.DEV
    fake, engine_url = await fake_engine(abort_route=abort_route, max_tokens=100)
    server = await tether(engine_url, engine=engine, **options)
    body = {**chat_body(stream=True, max_tokens=100), field: body_id}
    headers = {"X-Request-Id": header} if header is not None else None
    async with http.post(url(server), json=body, headers=headers) as response:
        answer = await response.read()
    assert response.status == 400
    error = json.loads(answer)["error"]
    assert error["code"] == "invalid_request_id" and f"the body's {field}" in error["message"]
    assert len(answer) < 1024
    assert fake.requests == []


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
