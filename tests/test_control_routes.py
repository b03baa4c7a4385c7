"""Engine control routes are never reachable through tether, in any spelling."""

from __future__ import annotations

import aiohttp
import pytest
from yarl import URL

from proxy.engines import (
    Engine,
    control_routes,
    engine_profile,
    public_routes,
    refused_control_routes,
)
from proxy.wire.routes import is_allowed, is_blocked, normalised_path

from .support.canaries import CANARY_PROMPT
from .support.chat import chat_body
from .support.in_process import TetherFactory, url
from .support.raw_http import RawClient, request_head
from .support.settings import make_settings
from .support.upstreams import FakeEngineFactory

NEEDS = {Engine.GENERIC: {"abort_url": "/abort/{internal_request_id}"}}

# The oracle, written out rather than taken from the code under test: every control route of
# the engines' real route tables (vLLM 0.32.0: `build_app` under every flag, environment and
# model-task combination; SGLang 0.5.23: `http_server.app` with the routers it includes), path
# parameters filled in.
VLLM_0_32_CONTROL = [
    "/abort_requests", "/adapters", "/adapters/x", "/collective_rpc", "/fault_tolerance/apply",
    "/fault_tolerance/status", "/finish_weight_update", "/get_world_size",
    "/inference/v1/abort_requests", "/init_weight_transfer_engine", "/is_paused",
    "/is_scaling_elastic_ep", "/is_sleeping", "/kv_event_sources", "/pause",
    "/release_kv_cache_memory", "/reset_encoder_cache", "/reset_mm_cache",
    "/reset_prefix_cache", "/resume", "/scale_elastic_ep", "/server_info",
    "/shutdown_weight_transfer_engine", "/sleep", "/start_draft_weight_update", "/start_profile",
    "/start_weight_update", "/stop_profile", "/update_weight_version", "/update_weights",
    "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/wake_up", "/weight_checker",
    "/weight_info",
]  # fmt: skip
SGLANG_0_5_23_CONTROL = [
    "/abort_request", "/add_external_corpus", "/begin_weight_update", "/close_session",
    "/configure_logging", "/continue_generation", "/destroy_weights_update_group",
    "/dump_expert_distribution_record", "/dumper/x", "/end_weight_update", "/flush_cache",
    "/freeze_gc", "/get_hicache_l3_cache_layout", "/get_remote_instance_transfer_engine_info",
    "/get_server_info", "/get_weights_by_name", "/hicache/storage-backend",
    "/hicache/storage-backend/clear", "/init_weights_send_group_for_remote_instance",
    "/init_weights_update_group", "/is_scaling_elastic_ep", "/list_external_corpora",
    "/load_lora_adapter", "/load_lora_adapter_from_tensors", "/open_session",
    "/pause_generation", "/pd_role_switch", "/release_memory_occupation",
    "/remote_instance_transfer_engine_info", "/remove_external_corpus",
    "/resume_memory_occupation", "/scale_elastic_ep", "/send_weights_to_remote_instance",
    "/server_info", "/set_internal_state", "/set_trace_level", "/slow_down",
    "/start_expert_distribution_record", "/start_profile", "/stop_expert_distribution_record",
    "/stop_profile", "/unload_lora_adapter", "/update_weight_version",
    "/update_weights_from_disk", "/update_weights_from_distributed", "/update_weights_from_ipc",
    "/update_weights_from_tensor", "/weights_checker",
]  # fmt: skip
# Routes of the same tables every client uses: never blocked.
VLLM_0_32_PUBLIC = [
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens",
    "/v1/responses", "/v1/responses/resp_x", "/v1/responses/resp_x/cancel", "/v1/embeddings",
    "/v1/audio/transcriptions", "/v1/realtime", "/v1/models", "/v1/score", "/v1/rerank",
    "/v2/rerank", "/v2/embed", "/pooling", "/classify", "/score", "/rerank", "/invocations",
    "/ping", "/tokenize", "/detokenize", "/health", "/load", "/version", "/metrics",
]  # fmt: skip
SGLANG_0_5_23_PUBLIC = [
    "/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses",
    "/v1/responses/resp_x/cancel", "/v1/embeddings", "/v1/models", "/v1/models/a/b",
    "/v1/loads", "/v1/tokenize", "/generate", "/encode", "/classify", "/invocations",
    "/vertex_generate", "/api/chat", "/api/generate", "/api/tags", "/tokenize", "/health",
    "/health_generate", "/get_model_info", "/model_info", "/metrics",
]  # fmt: skip
CONTROL = {Engine.VLLM: VLLM_0_32_CONTROL, Engine.SGLANG: SGLANG_0_5_23_CONTROL}
PUBLIC = {Engine.VLLM: VLLM_0_32_PUBLIC, Engine.SGLANG: SGLANG_0_5_23_PUBLIC}


def spellings(path: str) -> list[str]:
    """`path` as a client could write it for a router that decodes, folds and normalises."""
    rest = path[1:]
    return [
        path,
        "/" + path,  # //abort_requests
        "/%2F" + rest,
        "/%2f" + rest,
        path + "/",
        path.upper(),
        "/v1/.." + path,
        "/." + path,
        "/%" + f"{ord(rest[0]):02x}" + rest[1:],  # the first letter percent-encoded
        "/%252F" + rest,  # encoded twice
        "\\" + rest,  # a backslash for the slash
        path + "?x=1",
        path + "#frag",
    ]


@pytest.mark.socket_free
@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG, Engine.GENERIC, Engine.NONE])
def test_every_control_route_of_the_real_engines_is_blocked_in_every_spelling(
    engine: Engine,
) -> None:
    """Each control route of vLLM 0.32's and SGLang 0.5.23's route tables, in every
    spelling, is blocked in front of its engine; in front of an engine tether does not know
    (generic, none), every one of both is."""
    blocked = control_routes(engine)
    expected = CONTROL.get(engine, VLLM_0_32_CONTROL + SGLANG_0_5_23_CONTROL)
    missed = [s for path in expected for s in spellings(path) if not is_blocked(s, blocked)]
    assert missed == []


@pytest.mark.socket_free
@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
def test_the_engines_public_routes_are_neither_blocked_nor_left_out_of_public(
    engine: Engine,
) -> None:
    """What clients use passes the block list, and `TETHER_ALLOWED_PATHS=public` lets it
    through; none of the control routes is public."""
    blocked, public = control_routes(engine), public_routes(engine)
    assert [path for path in PUBLIC[engine] if is_blocked(path, blocked)] == []
    assert [path for path in PUBLIC[engine] if not is_allowed(path, public)] == []
    assert [path for path in CONTROL[engine] if is_allowed(path, public)] == []


@pytest.mark.socket_free
def test_normalisation_is_stable() -> None:
    """Normalising twice changes nothing."""
    for path in VLLM_0_32_CONTROL + SGLANG_0_5_23_CONTROL:
        for spelling in spellings(path):
            assert normalised_path(normalised_path(spelling)) == normalised_path(spelling)


@pytest.mark.socket_free
def test_an_allowlist_matches_whole_segments() -> None:
    """`/v1/responses` allows the handle routes below it, never a sibling sharing its start."""
    allowed = ("/v1/responses", "/health")
    assert is_allowed("/v1/responses/resp_1/cancel", allowed)
    assert is_allowed("/V1//responses/", allowed)
    assert not is_allowed("/v1/responses_admin", allowed)
    assert not is_allowed("/healthz", allowed)


@pytest.mark.socket_free
def test_the_profile_takes_the_operators_lists_over_the_built_in_ones() -> None:
    """TETHER_BLOCKED_PATHS replaces the built-in block list; `public` expands to the
    engine's routes."""
    settings = make_settings(engine="vllm", blocked_paths="/secret", allowed_paths="public")
    profile = engine_profile(settings)
    assert profile.blocked_paths == ("/secret",)
    assert profile.allowed_paths == public_routes(Engine.VLLM)


@pytest.mark.socket_free
@pytest.mark.parametrize("engine", list(Engine))
def test_every_known_engines_control_routes_are_refused_whatever_the_profile(
    engine: Engine,
) -> None:
    """An engine configured or identified wrongly never opens another's control routes:
    every profile refuses the union of every engine's (SGLang's /abort_request and
    /get_server_info in front of vLLM, vLLM's /abort_requests in front of SGLang)."""
    settings = make_settings(engine=engine, **NEEDS.get(engine, {}))
    blocked = engine_profile(settings).blocked_paths
    assert blocked == refused_control_routes()
    every = VLLM_0_32_CONTROL + SGLANG_0_5_23_CONTROL
    assert [s for path in every for s in spellings(path) if not is_blocked(s, blocked)] == []


@pytest.mark.socket_free
@pytest.mark.parametrize("engine", [Engine.VLLM, Engine.SGLANG])
def test_no_engines_public_route_is_among_the_refused(engine: Engine) -> None:
    """What any engine's clients use passes the union of every engine's control routes."""
    assert [p for p in PUBLIC[engine] if is_blocked(p, refused_control_routes())] == []


@pytest.mark.socket_free
def test_a_control_route_the_operator_names_allowed_is_not_refused() -> None:
    """TETHER_ALLOWED_PATHS naming a control route (or one below it) lets that route
    through the union; the allowlist still refuses everything else."""
    settings = make_settings(allowed_paths="/v1/chat/completions,/flush_cache")
    profile = engine_profile(settings)
    assert not is_blocked("/flush_cache", profile.blocked_paths)
    assert is_blocked("/abort_request", profile.blocked_paths)
    assert is_allowed("/flush_cache", profile.allowed_paths or ())


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


@pytest.mark.parametrize(
    ("request_line", "status", "code"),
    [
        ("CONNECT engine:443 HTTP/1.1", 405, "method_not_allowed"),
        ("TRACE /v1/models HTTP/1.1", 405, "method_not_allowed"),
        ("GET /v1/models HTTP/2.0", 505, "http_version_not_supported"),
        ("GET /v1/models HTTP/0.9", 505, "http_version_not_supported"),
        ("GET /v1/models", 505, "http_version_not_supported"),  # HTTP/0.9's bare form
    ],
)
async def test_tunnels_echoes_and_other_protocols_are_refused_never_forwarded(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    request_line: str,
    status: int,
    code: str,
) -> None:
    """CONNECT (a tunnel) and TRACE (an echo of the request, credentials included) get 405,
    request lines that are neither HTTP/1.0 nor HTTP/1.1 get 505, all as JSON errors; the
    engine sees none of them."""
    engine, engine_url = await fake_engine()
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send(f"{request_line}\r\nHost: engine\r\n\r\n".encode())
    reply = await client.read_reply()
    client.close_fin()

    assert reply.status == status
    assert reply.json()["error"]["code"] == code
    assert engine.requests == []


async def test_with_an_allowlist_only_its_routes_are_forwarded(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """TETHER_ALLOWED_PATHS=public: the engine's client routes pass, anything else (a path
    the engine might serve that is on no list) gets 403 `route_not_allowed`, unforwarded."""
    engine, engine_url = await fake_engine(max_tokens=1)
    server = await tether(engine_url, allowed_paths="public")
    async with http.post(url(server), json=chat_body(stream=False, max_tokens=1)) as response:
        assert response.status == 200
    async with http.post(url(server, "/echo/debug"), json={}) as response:
        assert response.status == 403
        assert (await response.json())["error"]["code"] == "route_not_allowed"
    assert [request.path for request in engine.requests] == ["/v1/chat/completions"]
