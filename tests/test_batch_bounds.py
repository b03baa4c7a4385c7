"""A client's batch cannot multiply what tether does for it: a batch that would start more
engine requests than TETHER_MAX_ENGINE_REQUESTS is refused before the engine sees it, the
abort of an allowed one holds a few engine connections at most (one call per item where the
engine names one request per call, one call where it takes lists), and its log line names a
sample of the engine IDs and their count, never the whole list."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from proxy.request.abort_report import LOGGED_ENGINE_IDS
from tether_fake_engine import AbortRoute, GenerationState

from .support.in_process import TetherFactory, drained, url
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory

LIMIT = 256  # TETHER_MAX_ENGINE_REQUESTS's default


def prompts(count: int) -> list[str]:
    return [f"prompt {index}" for index in range(count)]


@pytest.mark.parametrize(
    ("engine", "path", "body"),
    [
        ("vllm", "/v1/completions", {"prompt": prompts(LIMIT + 1)}),
        ("vllm", "/v1/completions", {"prompt": prompts(64), "n": 5}),
        ("sglang", "/generate", {"text": prompts(LIMIT + 1)}),
        ("sglang", "/v1/completions", {"prompt": prompts(LIMIT + 1)}),
        ("sglang", "/v1/chat/completions", {"messages": [], "n": LIMIT + 1}),
    ],
    ids=["vllm-prompts", "vllm-prompts-times-n", "sglang-generate", "sglang-prompts", "sglang-n"],
)
async def test_a_batch_over_the_limit_is_refused_before_the_engine(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    engine: str,
    path: str,
    body: dict[str, Any],
) -> None:
    """More engine requests than the limit (prompts times n): 400
    `too_many_engine_requests` naming the setting, and the engine never sees the request."""
    abort_route = AbortRoute.SGLANG if engine == "sglang" else AbortRoute.DEV
    fake, engine_url = await fake_engine(abort_route=abort_route)
    server = await tether(engine_url, engine=engine)
    async with http.post(url(server, path), json={**body, "max_tokens": 3}) as response:
        error = (await response.json())["error"]
    assert response.status == 400
    assert error["code"] == "too_many_engine_requests"
    assert "TETHER_MAX_ENGINE_REQUESTS" in error["message"]
    assert fake.requests == []


async def test_a_batch_at_the_limit_runs(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The limit itself is allowed: a batch of exactly TETHER_MAX_ENGINE_REQUESTS prompts
    reaches the engine and is answered."""
    fake, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url)
    body = {"prompt": prompts(LIMIT), "max_tokens": 1}
    async with http.post(url(server, "/v1/completions"), json=body) as response:
        assert response.status == 200
    assert len(fake.requests) == 1


async def leave_a_batch(server_port: int, path: str, body: dict[str, Any]) -> None:
    client = await RawClient.connect(server_port)
    await client.send_request({**body, "stream": True, "max_tokens": 100_000}, path=path)
    await client.read_until(b"tok0")
    client.close_fin()


async def test_an_sglang_batch_abort_holds_a_few_engine_connections(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """SGLang names one rid per call: a batch of 256 whose client leaves gets one call per
    item, each item named once, never more than 4 calls in flight at once (each holds an
    engine connection), and a log line with 4 of the IDs and their count."""
    fake, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG)
    fake.abort_answer_delay = 0.005  # calls overlap if tether lets them
    server = await tether(engine_url, engine="sglang")
    await leave_a_batch(server.port, "/generate", {"text": prompts(LIMIT)})
    await fake.wait_for(lambda: len(fake.aborts) == LIMIT, timeout=20)
    await drained(server, timeout=20)

    [generation] = fake.generations.values()
    rid = generation.request_id
    assert sorted(abort.ids for abort in fake.aborts) == sorted(
        (f"{rid}_{index}",) for index in range(LIMIT)
    )
    assert fake.peak_aborts_in_flight <= 4
    assert generation.state is GenerationState.ABORTED
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    [sent] = [line for line in lines if line.get("event") == "abort_sent"]
    assert sent["engine_request_count"] == LIMIT
    assert sent["engine_request_ids"] == [f"{rid}_{index}" for index in range(LOGGED_ENGINE_IDS)]


async def test_a_vllm_batch_abort_is_one_call(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """vLLM's abort takes a list: a batch of 256 whose client leaves is stopped by one call
    naming every prompt's engine request."""
    fake, engine_url = await fake_engine()
    server = await tether(engine_url)
    await leave_a_batch(server.port, "/v1/completions", {"prompt": prompts(LIMIT)})
    await fake.wait_for(lambda: fake.aborts != [])
    await drained(server)

    [generation] = fake.generations.values()
    [call] = fake.aborts
    assert sorted(call.ids) == sorted(generation.engine_ids) and len(call.ids) == LIMIT
    assert generation.state is GenerationState.ABORTED
