"""Every request is unique upstream; every client sees only its own ID."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.wire.ids import (
    IdMapper,
    IdMinter,
    InvalidClientRequestId,
    check_client_request_id,
    json_escaped,
)
from proxy.wire.json_members import InvalidJsonBody, JsonObject
from tether_fake_engine import AbortRoute

from .support.canaries import CANARY_PROMPT
from .support.chat import chat_body, sse_ids
from .support.in_process import TetherFactory, settled, url
from .support.upstreams import FakeEngineFactory

# --- pure: minting, checking, rewriting -------------------------------------------------------


@pytest.mark.socket_free
def test_internal_ids_are_fixed_length_hex_and_unique() -> None:
    """Internal IDs are 32 hex characters (prefix-free, never `_<digit>`) and never repeat."""
    minter = IdMinter()
    ids = {minter.mint() for _ in range(10_000)}  # many batches of fetched randomness
    assert len(ids) == 10_000
    assert all(re.fullmatch(r"[0-9a-f]{32}", value) for value in ids)


@pytest.mark.socket_free
@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "empty"),
        ("x" * 257, "limit is 256"),
        ("a b", "visible ASCII"),
        ("a\r\nX-Evil: 1", "visible ASCII"),
        ("caf\u00e9", "visible ASCII"),
        ("tab\there", "visible ASCII"),
    ],
)
def test_unusable_client_ids_are_refused_with_a_reason(value: str, problem: str) -> None:
    """Client IDs that could inject headers or logs, or bloat every chunk, are refused."""
    with pytest.raises(InvalidClientRequestId, match=problem):
        check_client_request_id(value)


@pytest.mark.socket_free
@pytest.mark.parametrize("value", ["abc", "x" * 256, 'quote"and\\backslash', "req-1_2.3:4/5"])
def test_visible_ascii_client_ids_up_to_256_are_accepted(value: str) -> None:
    """Any visible ASCII ID up to 256 characters is the client's to choose."""
    assert check_client_request_id(value) == value


@pytest.mark.socket_free
def test_body_fields_are_set_and_every_other_byte_kept() -> None:
    """Writing the ID into a JSON body replaces only that field's value: every other byte
    (spacing, key order, number spellings, escapes, a router's `kv_transfer_params`) is as the
    client sent it."""
    body = (
        b'{ "request_id" : "client",\n "stream": true, "text": "'
        + CANARY_PROMPT.encode()
        + b' h\\u00e9llo", "kv_transfer_params": {"remote_block_ids": [1, 2], "lease": 30.0,'
        b' "x": 1e2}}'
    )
    edited = JsonObject(body, ["request_id"]).with_members({"request_id": "internal"})
    assert edited == body.replace(b'"client"', b'"internal"')


@pytest.mark.socket_free
def test_a_missing_field_is_added_first_and_a_repeated_one_set_everywhere() -> None:
    """An absent field goes in right after the opening brace; a name written twice (which
    json.loads reads as its last) gets tether's value in both places."""
    assert JsonObject(b'{"a": 1}', ["rid"]).with_members({"rid": "x"}) == b'{"rid":"x","a": 1}'
    assert JsonObject(b"{ }", ["rid"]).with_members({"rid": "x"}) == b'{"rid":"x" }'
    twice = JsonObject(b'{"rid": "a", "rid": "b"}', ["rid"])
    assert twice.scalar("rid") == "b"
    assert twice.with_members({"rid": "x"}) == b'{"rid": "x", "rid": "x"}'


@pytest.mark.socket_free
def test_a_dotted_field_is_set_inside_its_object_or_makes_one() -> None:
    """`parameters.rid` sets a member of `parameters`, keeping its other bytes; where
    `parameters` is missing or not an object, it becomes one."""
    body = b'{"parameters": {"temperature": 0.50, "rid": "mine"}, "instances": []}'
    edited = JsonObject(body, ["parameters"]).with_members({"parameters.rid": "x"})
    assert edited == body.replace(b'"mine"', b'"x"')
    not_an_object = JsonObject(b'{"parameters": 3}', ["parameters"])
    assert json.loads(not_an_object.with_members({"parameters.rid": "x"})) == {
        "parameters": {"rid": "x"}
    }
    missing = JsonObject(b'{"a": 1}', ["parameters"])
    assert json.loads(missing.with_members({"parameters.rid": "x"})) == {
        "parameters": {"rid": "x"},
        "a": 1,
    }


@pytest.mark.socket_free
@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_a_body_in_another_utf_is_read_and_written_as_utf8(encoding: str) -> None:
    """A body json.loads reads (another UTF, a BOM) is edited too, and goes out as UTF-8."""
    body = json.dumps({"rid": "client", "text": "héllo"}).encode(encoding)
    document = JsonObject(body, ["rid"])
    assert document.scalar("rid") == "client"
    assert json.loads(document.with_members({"rid": "x"}).decode("utf-8")) == {
        "rid": "x",
        "text": "héllo",
    }


@pytest.mark.socket_free
@pytest.mark.parametrize(
    "body", [b"{not json", b"[1, 2]", b"\xff\xfe", b'{"a": 1} trailing', b'"text"', b"", b"{"]
)
def test_bodies_that_are_not_json_objects_are_refused(body: bytes) -> None:
    """tether cannot write its ID into a body that is not a JSON object."""
    with pytest.raises(InvalidJsonBody):
        JsonObject(body, ["rid"])


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)


@pytest.mark.socket_free
@given(
    st.dictionaries(st.text(max_size=8), _json_values, max_size=6),
    st.dictionaries(st.sampled_from(["rid", "request_id", "stream_options"]), _json_values),
    st.booleans(),
)
def test_setting_members_is_what_json_would_read(
    document: dict[str, Any], values: dict[str, Any], spaced: bool
) -> None:
    """Whatever the object and however it is spaced: after setting some members, the body
    reads (json.loads) as the object with those values, and every member not set keeps its
    text byte for byte."""
    separators = (", ", ": ") if spaced else (",", ":")
    body = json.dumps(document, separators=separators, ensure_ascii=False).encode()
    edited = JsonObject(body, values).with_members(values)
    assert json.loads(edited) == {**document, **values}
    for name, value in document.items():
        if name not in values:
            written = json.dumps({name: value}, separators=separators, ensure_ascii=False)
            assert written[1:-1].encode() in edited


def _map_in_pieces(internal: str, client: str, data: bytes, cuts: list[int]) -> bytes:
    mapper = IdMapper(internal, json_escaped(client))
    out, start = [], 0
    for cut in [*sorted(cuts), len(data)]:
        out.append(mapper.feed(data[start:cut]))
        start = cut
    out.append(mapper.flush())
    return b"".join(out)


@pytest.mark.socket_free
@given(
    client=st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40
    ),
    fillers=st.lists(st.binary(max_size=30), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_mapping_back_is_independent_of_chunk_boundaries(
    client: str, fillers: list[bytes], cuts: list[int]
) -> None:
    """Wherever the network cuts the stream, every internal ID becomes the client's ID."""
    internal = IdMinter().mint()
    data = internal.encode().join(fillers)
    cuts = [cut for cut in cuts if cut <= len(data)]
    expected = data.replace(internal.encode(), json_escaped(client))
    assert _map_in_pieces(internal, client, data, cuts) == expected


@pytest.mark.socket_free
def test_mapped_ids_stay_valid_json_whatever_the_client_id() -> None:
    """Quotes and backslashes in the client's ID are escaped inside JSON strings."""
    internal = IdMinter().mint()
    body = json.dumps({"id": f"chatcmpl-{internal}"}).encode()
    mapped = _map_in_pieces(internal, 'a"b\\c', body, [20])
    assert json.loads(mapped) == {"id": 'chatcmpl-a"b\\c'}


@pytest.mark.socket_free
def test_mapper_holds_back_nothing_at_an_event_boundary() -> None:
    """A chunk ending in a blank line is passed on whole: no added latency for SSE."""
    internal = IdMinter().mint()
    mapper = IdMapper(internal, b"client")
    event = b'data: {"id":"chatcmpl-' + internal.encode() + b'"}\n\n'
    assert mapper.feed(event) == b'data: {"id":"chatcmpl-client"}\n\n'


# --- through tether -----------------------------------------------------------------------------


async def test_duplicate_client_ids_are_distinct_upstream_and_mapped_back(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """Two in-flight requests with one client ID are two requests to the engine, and each
    client gets its own ID back in the header and in every event."""
    engine, engine_url = await fake_engine(max_tokens=20, token_interval=0.005)
    server = await tether(engine_url)

    async def call() -> tuple[str, list[str]]:
        async with http.post(
            url(server), json=chat_body(max_tokens=20), headers={"X-Request-Id": "dup"}
        ) as response:
            return response.headers["X-Request-Id"], sse_ids(await response.text())

    results = await asyncio.gather(call(), call())

    assert len(engine.generations) == 2
    for internal_id in engine.generations:
        assert re.fullmatch(r"[0-9a-f]{32}", internal_id)
    for header, ids in results:
        assert header == "dup"
        assert ids and set(ids) == {"chatcmpl-dup"}


async def test_client_without_an_id_gets_one(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A request without X-Request-Id gets a generated ID, in the header and the body."""
    _, engine_url = await fake_engine(max_tokens=2)
    server = await tether(engine_url)
    async with http.post(url(server), json=chat_body(stream=False)) as response:
        generated = response.headers["X-Request-Id"]
        body = await response.json()
    assert body["id"] == f"chatcmpl-{generated}"


async def test_invalid_client_id_gets_a_400_and_never_reaches_the_engine(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """An oversized ID is refused with an OpenAI-style error naming the header."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "x" * 300}) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["code"] == "invalid_request_id"
    assert "X-Request-Id" in error["message"]
    assert engine.requests == []


async def test_custom_client_header_name(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """TETHER_REQUEST_ID_HEADER names the header clients use; the engine still gets X-Request-Id."""
    engine, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url, request_id_header="X-Correlation-Id")
    async with http.post(
        url(server), json=chat_body(stream=False), headers={"X-Correlation-Id": "corr-1"}
    ) as response:
        assert response.headers["X-Correlation-Id"] == "corr-1"
        assert (await response.json())["id"] == "chatcmpl-corr-1"
    assert "X-Correlation-Id" not in engine.requests[0].headers


async def test_vllm_body_request_id_is_replaced(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A client's `request_id` in the body cannot reach vLLM either."""
    engine, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url)
    body = {**chat_body(stream=False), "request_id": "client-chosen"}
    async with http.post(url(server), json=body) as response:
        assert response.status == 200
    seen = json.loads(engine.requests[0].body)
    assert seen["request_id"] == engine.requests[0].headers["X-Request-Id"]
    assert seen["request_id"] != "client-chosen"


async def test_sglang_gets_the_internal_id_as_rid(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """For SGLang the internal ID goes into the body as `rid`, and comes back mapped."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG, max_tokens=2)
    server = await tether(engine_url, engine="sglang")
    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "sg"}) as r:
        ids = sse_ids(await r.text())
    [internal_id] = engine.generations
    assert json.loads(engine.requests[0].body)["rid"] == internal_id
    assert set(ids) == {"sg"}


async def test_invalid_json_body_where_the_id_must_go_is_a_400(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """SGLang needs the ID in the body: a body that is not JSON gets a clear 400."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url, engine="sglang")
    async with http.post(
        url(server),
        data=b'{"prompt": "' + CANARY_PROMPT.encode() + b'" broken',
        headers={"Content-Type": "application/json"},
    ) as response:
        assert response.status == 400
        assert (await response.json())["error"]["code"] == "invalid_request_body"
    assert engine.requests == []


async def test_registry_tracks_in_flight_requests_by_client_id(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """While requests run, the registry maps the client ID to each internal ID; then empties."""
    engine, engine_url = await fake_engine(max_tokens=10_000, token_interval=0.01)
    server = await tether(engine_url)
    responses = [
        await http.post(
            url(server), json=chat_body(max_tokens=10_000), headers={"X-Request-Id": "tracked"}
        )
        for _ in range(2)
    ]
    for response in responses:
        await response.content.readuntil(b"tok0")

    found = server.context.registry.find("tracked")
    assert {state.internal_request_id for state in found} == set(engine.generations)
    for internal_id in engine.generations:
        assert server.context.registry.find(internal_id)[0].client_request_id == "tracked"

    for response in responses:
        response.close()
    await settled(server)
    assert server.context.registry.find("tracked") == []
