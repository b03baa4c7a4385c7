"""tether knows which engine it fronts without being told (TETHER_ENGINE=auto, the default):
it asks at start-up and whenever the engine comes back, serves what answered with that
engine's profile, and until an engine names itself (or for one that never does) refuses
every known engine's control routes and stops requests by dropping the connection. A
configured engine the engine contradicts is a warning, never trusted silently."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest

from proxy.engines import Engine
from proxy.engines.identify import Identity, identify
from proxy.server.runner import TetherServer
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.chat import chat_body
from .support.in_process import TetherFactory, admin_url, drained, leave_mid_stream, url
from .support.metrics import metric
from .support.net import free_port
from .support.upstreams import FakeEngineFactory, serve_upstream
from .support.waiting import poll_until

# --- what each engine answers (read in its source, or from the running engine) ------------

VLLM = {
    "/version": {"version": "0.32.0"},
    "/v1/models": {"object": "list", "data": [{"id": "tiny", "owned_by": "vllm"}]},
}
SGLANG = {
    "/model_info": {
        "model_path": "/models/tiny",
        "tokenizer_path": "/models/tiny",
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
    },
    "/v1/models": {"object": "list", "data": [{"id": "tiny", "owned_by": "sglang"}]},
}
LLAMACPP = {
    "/props": {
        "default_generation_settings": {"n_ctx": 2048},
        "total_slots": 1,
        "model_path": "/models/tiny.gguf",
        "build_info": "b11434-abcdef",
    },
    "/v1/models": {"object": "list", "data": [{"id": "tiny", "owned_by": "llamacpp"}]},
}
TGI = {"/info": {"model_id": "tiny", "router": "text-generation-router", "version": "3.3.6"}}
OLLAMA = {"/api/version": {"version": "0.31.2"}}


@pytest.mark.socket_free
@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        (VLLM, Identity("vllm", "vllm", "0.32.0", "GET /version, GET /v1/models")),
        (SGLANG, Identity("sglang", "sglang", None, "GET /model_info")),
        (
            {"/get_model_info": SGLANG["/model_info"]},
            Identity("sglang", "sglang", None, "GET /get_model_info"),
        ),
        (LLAMACPP, Identity("llamacpp", "llamacpp", "b11434-abcdef", "GET /props", 1)),
        (TGI, Identity("tgi", "none", "3.3.6", "GET /info")),
        (OLLAMA, Identity("ollama", "none", "0.31.2", "GET /api/version")),
        # TensorRT-LLM serves /version too; its model cards are not vLLM's.
        (
            {
                "/version": {"version": "1.2.0"},
                "/v1/models": {"data": [{"id": "m", "owned_by": "tensorrt_llm"}]},
            },
            None,
        ),
        # vLLM with --api-key guards /v1/models: /version alone names no engine.
        ({"/version": {"version": "0.32.0"}}, None),
        ({"/v1/models": {"data": [{"id": "fake"}]}}, None),
        ({}, None),
    ],
    ids=[
        "vllm",
        "sglang",
        "sglang-older",
        "llamacpp",
        "tgi",
        "ollama",
        "trt-llm",
        "vllm-api-key",
        "anon",
        "none",
    ],
)
def test_each_engine_is_named_by_its_own_answers(
    answers: dict[str, Any], expected: Identity | None
) -> None:
    """Only a shape that engine's own route gives names it; a lookalike names nothing."""
    assert identify(answers) == expected


# --- against engines that answer -----------------------------------------------------------


def log_events(out: str, event: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in out.splitlines() if line[:1] == "{"]
    return [line for line in lines if line.get("event") == event]


def engine_info(server: TetherServer, **labels: str) -> float:
    return metric(server.context.metrics.registry, "tether_engine_info", **labels)


async def test_vllm_is_identified_and_served_as_vllm(
    fake_engine: FakeEngineFactory, tether: TetherFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    """With no TETHER_ENGINE, a vLLM is asked, named in the log and the metric, and its
    requests are aborted through vLLM's route when their client leaves."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url)
    assert server.context.engine.engine == Engine.VLLM
    await leave_mid_stream(server)
    await drained(server)

    [generation] = engine.generations.values()
    assert generation.state is GenerationState.ABORTED and generation.stopped_by == "abort"
    [identified] = log_events(capsys.readouterr().out, "engine_identified")
    assert (identified["engine"], identified["profile"]) == ("vllm", "vllm")
    assert identified["version"] == "0.32.0+fake"
    labels = {"configured": "auto", "identified": "vllm", "profile": "vllm"}
    assert engine_info(server, **labels, version="0.32.0+fake") == 1


async def test_sglang_is_identified_and_served_as_sglang(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """With no TETHER_ENGINE, an SGLang gets tether's rid and its abort by rid."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG, token_interval=0.01)
    server = await tether(engine_url)
    assert server.context.engine.engine == Engine.SGLANG
    await leave_mid_stream(server)
    await drained(server)

    [generation] = engine.generations.values()
    assert [abort.ids for abort in engine.aborts] == [(generation.request_id,)]
    assert generation.state is GenerationState.ABORTED


CONTROL = ["/abort_requests", "/abort_request", "/get_server_info", "/flush_cache", "/pause"]


async def test_an_engine_that_names_no_known_engine_is_served_safely(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An engine that says nothing tether recognises: every known engine's control routes
    are refused (SGLang's abort by prefix and its key-leaking server info, vLLM's abort
    list), no abort call goes out (the dropped connection stops the request), a client's
    own `rid` never reaches the engine, and the log says what to set."""
    engine, engine_url = await fake_engine(
        identifiable=False, hears_disconnects=True, token_interval=0.01
    )
    server = await tether(engine_url)
    for path in CONTROL:
        async with http.post(url(server, path), json={"rid": ""}) as response:
            assert response.status == 403, path
    assert engine.requests == []

    body = {**chat_body(stream=False), "rid": "a", "request_id": "mine"}
    async with http.post(url(server), json=body) as response:
        assert response.status == 200
    sent = json.loads(engine.requests[0].body)
    assert sent["rid"] == sent["request_id"] != "a"

    await leave_mid_stream(server)
    await drained(server)
    await engine.wait_for(
        lambda: [g.stopped_by for g in engine.generations.values()] == [None, "disconnect"]
    )
    assert engine.aborts == []
    [unknown] = log_events(capsys.readouterr().out, "engine_not_identified")
    assert "set TETHER_ENGINE" in unknown["consequence"]
    labels = {"configured": "auto", "identified": "unknown", "profile": "auto"}
    assert engine_info(server, **labels, version="") == 1


async def test_a_configured_engine_the_engine_contradicts_is_a_warning(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """TETHER_ENGINE=vllm in front of an SGLang: the configured profile decides, but the
    contradiction is a warning at start-up, in /readyz and in the metric; SGLang's control
    routes stay refused."""
    _, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG)
    server = await tether(engine_url, engine="vllm")
    assert server.context.engine.engine == Engine.VLLM
    [mismatch] = log_events(capsys.readouterr().out, "engine_mismatch")
    assert "TETHER_ENGINE=vllm" in mismatch["detail"] and "sglang" in mismatch["detail"]

    async def ready() -> bool:
        async with http.get(admin_url(server, "/readyz")) as response:
            return response.status == 200

    await poll_until(ready, 5, interval=0.02, what="/readyz to answer 200")
    async with http.get(admin_url(server, "/readyz")) as response:
        engine = (await response.json())["engine"]
    assert (engine["configured"], engine["identified"], engine["profile"]) == (
        "vllm",
        "sglang",
        "vllm",
    )
    assert "TETHER_ENGINE=vllm" in engine["warning"]
    labels = {"configured": "vllm", "identified": "sglang", "profile": "vllm"}
    assert engine_info(server, **labels, version="") == 1
    async with http.post(url(server, "/abort_request"), json={"rid": ""}) as response:
        assert response.status == 403


async def test_an_engine_that_starts_later_or_is_replaced_is_asked_again(
    tether: TetherFactory,
) -> None:
    """Nothing answers at start-up: the safe profile serves until the engine is up, then
    its own; when it comes back after an outage as another engine, that one's."""
    port = free_port()
    server = await tether(f"http://127.0.0.1:{port}")
    assert server.context.engine.engine == Engine.AUTO

    first = await serve_upstream(FakeEngine().app, port)
    await poll_until(
        lambda: server.context.engine.engine == Engine.VLLM, 5, what="vLLM to be identified"
    )
    await first.close()
    await poll_until(
        lambda: server.context.readiness.problem is not None, 5, what="the outage to be seen"
    )
    second = await serve_upstream(FakeEngine(abort_route=AbortRoute.SGLANG).app, port)
    try:
        await poll_until(
            lambda: server.context.engine.engine == Engine.SGLANG,
            5,
            what="SGLang to be identified",
        )
    finally:
        await second.close()
