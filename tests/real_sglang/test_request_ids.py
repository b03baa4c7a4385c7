"""Through tether, SGLang only ever sees tether's fixed-length rid, while clients see their own
ID in every chunk, body and header."""

from __future__ import annotations

import json

import pytest

from ..support.raw_http import RawExchange
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    COMPLETIONS_PATH,
    GENERATE_PATH,
    INTERNAL_ID,
    direct,
    internal_id_of,
    on_default,
    received_rids,
    request_for,
    response_id,
    via_tether,
)

ALL_ROUTES = (CHAT_PATH, COMPLETIONS_PATH, GENERATE_PATH)
CLIENTS_RID = "clients-own-rid"


def _slug(path: str) -> str:
    return path.strip("/").replace("/", "-")


def _streamed_chunks(exchange: RawExchange) -> list[dict[str, object]]:
    """Every JSON event of a whole stream, which must end with `[DONE]`."""
    events = list(exchange.events())
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(event) for event in events[:-1]]


@on_default
@pytest.mark.parametrize("path", ALL_ROUTES)
@pytest.mark.parametrize("own_rid", [False, True], ids=["no-body-rid", "client-body-rid"])
def test_sglang_receives_tethers_rid(stack: Stack, path: str, own_rid: bool) -> None:
    """SGLang gets tether's 32-hex rid in the body, whether or not the client sent its own;
    the answer's `id` is what SGLang alone would answer: the client's own rid where it sent
    one (SGLang does not read X-Request-Id), else its X-Request-Id."""
    client_request_id = f"ids-{_slug(path)}-{'own' if own_rid else 'none'}"
    extra = {"rid": CLIENTS_RID} if own_rid else {}
    sglang_mark, tether_mark = stack.sglang.log.mark(), stack.tether.log.mark()
    with via_tether(stack, client_request_id, path, request_for(path, 8, False, **extra)) as ex:
        assert ex.read_head() == 200
        answer = json.loads(ex.body())
        assert ex.headers["x-request-id"] == client_request_id
    assert response_id(answer) == (CLIENTS_RID if own_rid else client_request_id)
    (internal_request_id,) = internal_id_of(stack.tether, tether_mark, client_request_id)
    assert INTERNAL_ID.match(internal_request_id)
    assert received_rids(stack, sglang_mark) == [internal_request_id]
    log = stack.sglang.log.text_since(sglang_mark)
    assert client_request_id not in log and CLIENTS_RID not in log


@on_default
def test_body_without_content_type_gets_tethers_rid(stack: Stack) -> None:
    """A /generate body without Content-Type reaches SGLang with tether's rid in place of the
    client's: SGLang refuses it (400) and echoes the body it got, and tether maps its rid
    back to the client's own, so the echo reads as SGLang alone answers it."""
    payload = request_for(GENERATE_PATH, 8, False, rid=CLIENTS_RID)
    with direct(stack, GENERATE_PATH, payload, content_type=None) as alone:
        assert alone.read_head() == 400
        assert CLIENTS_RID in alone.body().decode()  # the echo shows the rid SGLang saw
    tether_mark = stack.tether.log.mark()
    with via_tether(stack, "untyped-1", GENERATE_PATH, payload, content_type=None) as exchange:
        assert exchange.read_head() == 400
        echo = exchange.body().decode()
    (internal_request_id,) = internal_id_of(stack.tether, tether_mark, "untyped-1")
    assert INTERNAL_ID.match(internal_request_id)
    # The client's rid is in the echo only as tether's rid mapped back (it never went
    # upstream: SGLang's log has tether's alone).
    assert CLIENTS_RID in echo and internal_request_id not in echo, echo[:400]


@on_default
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
def test_openai_routes_refuse_body_without_content_type(stack: Stack, path: str) -> None:
    """SGLang's OpenAI routes take only application/json (400 otherwise), through tether as
    without it: the rewrite of an unlabelled body matters on /generate only."""
    payload = request_for(path, 8, False)
    with direct(stack, path, payload, content_type=None) as alone:
        assert alone.read_head() == 400
        assert "Only 'application/json' is allowed" in alone.body().decode()
    with via_tether(stack, f"untyped-{_slug(path)}", path, payload, content_type=None) as ex:
        assert ex.read_head() == 400
        assert "Only 'application/json' is allowed" in ex.body().decode()


@on_default
@pytest.mark.parametrize("path", ALL_ROUTES)
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_client_id_in_every_chunk_body_and_header(stack: Stack, path: str, stream: bool) -> None:
    """The client's X-Request-Id comes back in the header and as the ID of every chunk and
    body (SGLang's ID is the rid itself: no `chatcmpl-` prefix)."""
    client_request_id = f"echo-{_slug(path)}-{'stream' if stream else 'plain'}"
    with via_tether(stack, client_request_id, path, request_for(path, 20, stream)) as exchange:
        assert exchange.read_head() == 200
        chunks = _streamed_chunks(exchange) if stream else [json.loads(exchange.body())]
    assert exchange.headers.get("x-request-id") == client_request_id
    # 20 tokens, in fewer chunks when SGLang coalesces tokens its HTTP handler fell behind on.
    assert len(chunks) >= (2 if stream else 1)
    assert {response_id(chunk) for chunk in chunks} == {client_request_id}


@on_default
def test_duplicate_client_ids_are_distinct_at_sglang(stack: Stack) -> None:
    """Three concurrent requests with one client ID and one body rid all succeed through
    tether, each under its own rid at SGLang, each answered with that rid as SGLang alone
    answers (had they not collided there)."""
    mark = stack.sglang.log.mark()
    payload = request_for(CHAT_PATH, 200, True, rid="shared-rid")
    exchanges = [via_tether(stack, "dup-client", CHAT_PATH, payload) for _ in range(3)]
    try:
        assert [exchange.read_head() for exchange in exchanges] == [200, 200, 200]
        first = [exchange.chunks(3) for exchange in exchanges]  # all three run at once
        rest = [_streamed_chunks(exchange) for exchange in exchanges]
    finally:
        for exchange in exchanges:
            exchange.close()
    rids = received_rids(stack, mark)
    assert len(rids) == 3 == len(set(rids)) and all(INTERNAL_ID.match(rid) for rid in rids), rids
    ids = {response_id(chunk) for chunks in first + rest for chunk in chunks}
    assert ids == {"shared-rid"}


@on_default
def test_duplicate_rids_collide_at_sglang_alone(stack: Stack) -> None:
    """The same three requests straight to SGLang: the first runs, the other two get 400
    "Duplicate request ID detected" (the contrast to the test above)."""
    payload = request_for(CHAT_PATH, 200, True, rid="shared-rid")
    exchanges = [direct(stack, CHAT_PATH, payload) for _ in range(3)]
    try:
        statuses = [exchange.read_head() for exchange in exchanges]
        refused = [exchange.body().decode() for exchange in exchanges if exchange.status != 200]
    finally:
        for exchange in exchanges:
            exchange.close()
    assert sorted(statuses) == [200, 400, 400], statuses
    assert all("Duplicate request ID detected" in body for body in refused), refused
