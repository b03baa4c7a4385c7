"""Engine control routes are never reachable through tether, in any spelling."""

from __future__ import annotations

import aiohttp
import pytest
from yarl import URL

from proxy.routes import is_blocked, normalised_path
from proxy.settings import DEFAULT_BLOCKED_PATHS

from .conftest import FakeEngineFactory, TetherFactory, chat_body, url
from .support.canaries import CANARY_PROMPT
from .support.raw_http import RawClient, request_head

SPELLINGS = [
    "/abort_requests",
    "//abort_requests",
    "/%2Fabort_requests",
    "/%2fabort_requests",
    "/abort_requests/",
    "/ABORT_REQUESTS",
    "/v1/../abort_requests",
    "/./abort_requests",
    "/%61bort_requests",
    "/%252Fabort_requests",
    "/abort_requests?x=1",
    "/abort_request",
    "/inference/v1/abort_requests",
    "/pause?mode=abort",
    "/resume",
    "/sleep",
    "/wake_up",
    "/collective_rpc",
    "/reset_prefix_cache",
    "/update_weights_from_disk",
    "/init_weight_transfer_engine",
]


@pytest.mark.parametrize("path", SPELLINGS)
def test_every_spelling_of_a_control_route_is_blocked(path: str) -> None:
    """Encodings, case, duplicate slashes and dot segments do not get past the block list."""
    assert is_blocked(path, DEFAULT_BLOCKED_PATHS)


@pytest.mark.parametrize(
    "path", ["/v1/chat/completions", "/v1/completions", "/health", "/v1/models", "/metrics"]
)
def test_inference_routes_are_not_blocked(path: str) -> None:
    """Ordinary API routes pass."""
    assert not is_blocked(path, DEFAULT_BLOCKED_PATHS)


def test_normalisation_is_stable() -> None:
    """Normalising twice changes nothing."""
    for path in SPELLINGS:
        assert normalised_path(normalised_path(path)) == normalised_path(path)


@pytest.mark.parametrize(
    "path",
    [
        "/abort_requests",
        "//abort_requests",
        "/%2Fabort_requests",
        "/abort_requests/",
        "/ABORT_REQUESTS",
        "/pause",
    ],
)
async def test_blocked_route_gets_403_json_and_never_reaches_the_engine(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession, path: str
) -> None:
    """A control route gets a 403 OpenAI-style error; the engine sees nothing."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    async with http.post(
        URL(url(server, path), encoded=True), json={"request_ids": []}
    ) as response:
        assert response.status == 403
        error = (await response.json())["error"]
    assert error["code"] == "blocked_route"
    assert error["type"] == "permission_error"
    assert engine.aborts == [] and engine.requests == []


async def test_block_list_is_configurable(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """TETHER_BLOCKED_PATHS replaces the built-in list."""
    _engine, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url, blocked_paths="/v1/completions, /secret")
    async with http.post(
        url(server, "/v1/completions"), json={"prompt": CANARY_PROMPT}
    ) as response:
        assert response.status == 403
    async with http.post(
        url(server, "/v1/chat/completions"), json=chat_body(stream=False, max_tokens=1)
    ) as response:
        assert response.status == 200


async def test_absolute_form_targets_are_checked_and_forwarded_by_path(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """`POST http://host/abort_requests` (proxy-style target) is refused like the path alone;
    other absolute-form targets reach the engine as their path."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    answers = []
    for target in ("http://engine/abort_requests", "http://engine/echo/x?y=1"):
        client = await RawClient.connect(server.port)
        headers = [("Content-Length", "2"), ("Connection", "close")]
        await client.send(request_head(target, headers=headers) + b"{}")
        reply = await client.read_reply()
        answers.append((reply.version, reply.status))
        await client.expect_closed()
        client.close_fin()
    assert answers == [("HTTP/1.1", 403), ("HTTP/1.1", 200)]
    assert [request.path for request in engine.requests] == ["/echo/x?y=1"]
    assert engine.aborts == []
