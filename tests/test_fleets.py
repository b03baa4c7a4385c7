"""Fleets: IDs a router or a P/D pair already made unique pass unchanged (`preserve` mode),
an abort by client ID reaches whichever replica holds the request, and what routers probe on
the pod's serving port reaches the engine untouched."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from proxy.server.runner import TetherServer
from tether_fake_engine import AbortRoute, FakeEngine, GenerationState

from .support.chat import chat_body
from .support.collected_log import CollectedLog
from .support.in_process import (
    TetherFactory,
    admin_url,
    drained,
    leave_mid_stream,
    settled,
    url,
)
from .support.metrics import metric
from .support.net import free_port
from .support.processes import TetherProcess, run_tether_cli, start_tether_process
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory

TOKEN = "fleet-test-token"

# --- preserve mode ------------------------------------------------------------------------------


async def test_preserve_mode_sends_the_clients_id_unchanged(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """The engine keys the request by the client's own ID (a router's, shared by a P/D pair);
    the client sees it everywhere, with nothing to map back."""
    engine, engine_url = await fake_engine(max_tokens=2)
    server = await tether(engine_url, request_id_mode="preserve")
    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "pd-7"}) as r:
        body = await r.text()
        assert r.headers["X-Request-Id"] == "pd-7"
    assert engine.requests[0].headers["X-Request-Id"] == "pd-7"
    assert '"id":"chatcmpl-pd-7"' in body


async def test_preserve_mode_refuses_a_true_duplicate_before_the_engine(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """A second request with an ID already in flight on this tether gets 409
    `duplicate_request_id` and never reaches the engine (whose state is keyed by it); once
    the first ended, the ID is free again."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, request_id_mode="preserve")
    first = RawClient(*await asyncio.open_connection("127.0.0.1", server.port))
    await first.send_request(chat_body(max_tokens=30), headers={"X-Request-Id": "dup"})
    await first.read_until(b"tok0")

    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "dup"}) as r:
        assert r.status == 409
        assert r.headers["X-Request-Id"] == "dup"
        assert (await r.json())["error"]["code"] == "duplicate_request_id"
    assert len(engine.requests) == 1

    await first.read_until(b"[DONE]")
    await settled(server)
    async with http.post(url(server), json=chat_body(), headers={"X-Request-Id": "dup"}) as r:
        assert r.status == 200
    registry = server.context.metrics.registry
    assert metric(registry, "tether_request_outcomes_total", outcome="rejected") == 1


@pytest.mark.parametrize(
    ("first", "second"), [("a", "ab"), ("ab", "a")], ids=["shorter-first", "longer-first"]
)
@pytest.mark.parametrize("where", ["header", "body"])
async def test_preserve_mode_refuses_an_id_overlapping_one_in_flight_where_aborts_match_prefixes(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    first: str,
    second: str,
    where: str,
) -> None:
    """SGLang aborts every rid that starts with the one named: in preserve mode a second
    request whose ID is a prefix of one in flight, or starts with one, gets 409
    `overlapping_request_id` and never reaches the engine; the first is not touched when its
    client leaves later, and once it ended the ID is free."""
    engine, engine_url = await fake_engine(abort_route=AbortRoute.SGLANG, token_interval=0.01)
    server = await tether(engine_url, engine="sglang", request_id_mode="preserve")

    def named(request_id: str, max_tokens: int = 5) -> tuple[dict[str, Any], dict[str, str]]:
        body = chat_body(max_tokens=max_tokens)
        if where == "header":
            return body, {"X-Request-Id": request_id}
        return {**body, "rid": request_id}, {}

    body, headers = named(first, max_tokens=100_000)
    client = await RawClient.connect(server.port)
    await client.send_request(body, headers=headers)
    await client.read_until(b"tok0")

    body, headers = named(second)
    async with http.post(url(server), json=body, headers=headers) as refused:
        assert refused.status == 409
        assert (await refused.json())["error"]["code"] == "overlapping_request_id"
    assert [generation.request_id for generation in engine.generations.values()] == [first]

    client.close_fin()
    await engine.wait_for(lambda: engine.generation(first).state is GenerationState.ABORTED)
    await settled(server)
    await drained(server)
    async with http.post(url(server), json=body, headers=headers) as allowed:
        assert allowed.status == 200


async def test_preserve_mode_lets_prefixes_run_together_where_aborts_match_exactly(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """vLLM aborts exact IDs: `a` and `ab` in flight at once are both served, and `a`'s
    client leaving stops `a` alone."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, request_id_mode="preserve")
    clients = []
    for request_id in ("a", "ab"):
        client = await RawClient.connect(server.port)
        await client.send_request(
            chat_body(max_tokens=100_000), headers={"X-Request-Id": request_id}
        )
        await client.read_until(b"tok0")
        clients.append(client)
    clients[0].close_fin()
    await engine.wait_for(lambda: engine.generation("a").state is GenerationState.ABORTED)
    await drained(server)
    assert engine.generation("ab").state is GenerationState.RUNNING
    clients[1].close_fin()


async def test_preserve_mode_keeps_a_pd_pair_intact_across_two_pods(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """llm-d sends one ID to the prefill pod and the decode pod at once: each pod's tether
    passes it unchanged (vLLM's NIXL connector pairs the halves by it)."""
    prefill, prefill_url = await fake_engine(max_tokens=3, token_interval=0.01)
    decode, decode_url = await fake_engine(max_tokens=3, token_interval=0.01)
    pods = [
        await tether(prefill_url, request_id_mode="preserve"),
        await tether(decode_url, request_id_mode="preserve"),
    ]

    async def send(server: TetherServer) -> int:
        headers = {"X-Request-Id": "pair-1"}
        async with http.post(url(server), json=chat_body(), headers=headers) as response:
            await response.read()
            return response.status

    assert await asyncio.gather(*(send(pod) for pod in pods)) == [200, 200]
    assert [e.requests[0].headers["X-Request-Id"] for e in (prefill, decode)] == ["pair-1"] * 2


# A body as a P/D router sends it: its own fields, numbers and spacing as it wrote them.
_ROUTED_BODY = (
    b'{"model": "fake", "messages": [{"role": "user", "content": "h\\u00e9llo"}],\n'
    b' "max_tokens": 3, "temperature": 0.70, "stream": %s,'
    b' "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [1, 2, 3],'
    b' "remote_engine_id": "prefill-0", "remote_host": "10.0.0.7", "lease": 30.0},'
    b' "router_hints": {"x-gateway-destination-endpoint": "10.0.0.8:8000"}}'
)


@pytest.mark.parametrize("stream", [False, True], ids=["non-streaming", "streaming"])
async def test_preserve_mode_passes_kv_transfer_params_and_router_fields_byte_for_byte(
    fake_engine: FakeEngineFactory, tether: TetherFactory, stream: bool
) -> None:
    """In preserve mode the engine gets the router's body as the router wrote it: its
    `kv_transfer_params`, its own fields, number spellings and spacing byte for byte; a
    stream gains only the usage tether asks for, as the body's first member."""
    engine, engine_url = await fake_engine(max_tokens=3)
    server = await tether(engine_url, request_id_mode="preserve")
    body = _ROUTED_BODY % (b"true" if stream else b"false")
    client = await RawClient.connect(server.port)
    await client.send_request(body, headers={"X-Request-Id": "pair-7"})
    reply = await client.read_reply()
    client.close_fin()

    assert reply.status == 200
    [seen] = engine.requests
    expected = (
        body.replace(b"{", b'{"stream_options":{"include_usage":true},', 1) if stream else body
    )
    assert seen.body == expected
    assert seen.headers["X-Request-Id"] == "pair-7"


async def test_preserve_mode_aborts_by_the_preserved_id(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client that leaves is aborted by the ID the engine knows: its own."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, request_id_mode="preserve")
    await leave_mid_stream(server, headers={"X-Request-Id": "gone"})
    await settled(server)
    await drained(server)
    assert engine.aborts[0].ids == ("chatcmpl-gone",)
    assert engine.generation("gone").state is GenerationState.ABORTED


# --- fleet-wide abort ---------------------------------------------------------------------------


async def start_replica(
    log: CollectedLog,
    engine: FakeEngine,
    engine_url: str,
    address: str,
    admin_port: int,
    **env: str,
) -> TetherProcess:
    return await start_tether_process(
        engine_url,
        log,
        {
            "TETHER_ADMIN_TOKEN": TOKEN,
            "TETHER_ADMIN_PORT": str(admin_port),
            "TETHER_REPLICA_NAME": f"replica-{address}",
            **env,
        },
        host=address,
    )


@pytest.fixture
async def replicas(
    fake_engine: FakeEngineFactory, collected_log: CollectedLog
) -> AsyncIterator[list[tuple[FakeEngine, TetherProcess]]]:
    """Three tethers, each in front of its own engine, on 127.0.0.2-4 with the same admin port
    (as pods behind a headless Service); each knows the others and one peer that is down."""
    admin_port = free_port()
    addresses = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    dead = f"127.0.0.5:{admin_port}"
    started: list[tuple[FakeEngine, TetherProcess]] = []
    for address in addresses:
        engine, engine_url = await fake_engine(token_interval=0.01)
        peers = ",".join(
            [f"{other}:{admin_port}" for other in addresses if other != address] + [dead]
        )
        started.append(
            (
                engine,
                await start_replica(
                    collected_log, engine, engine_url, address, admin_port, TETHER_FLEET_PEERS=peers
                ),
            )
        )
    yield started
    for _, process in started:
        await process.close()


async def test_fleet_abort_stops_the_request_on_whichever_replica_holds_it(
    replicas: list[tuple[FakeEngine, TetherProcess]], http: aiohttp.ClientSession
) -> None:
    """Started on replica 3, aborted through replica 1 with scope "fleet": the engine behind
    replica 3 gets the abort within 100 ms of the call, the answer names that replica and
    lists the peer that is down without failing."""
    (_, first), _, (engine, holder) = replicas
    client = await RawClient.connect(holder.port, host=holder.host)
    await client.send_request(chat_body(max_tokens=100_000), headers={"X-Request-Id": "job-42"})
    await client.read_until(b"tok0")

    started = time.monotonic()
    async with http.post(
        first.admin_url("/admin/abort"),
        json={"request_id": "job-42", "scope": "fleet"},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as response:
        answer = await response.json()
    await engine.wait_for(lambda: bool(engine.aborts))
    assert engine.aborts[0].at - started < 0.1

    assert answer["aborted"] == [] and answer["aborted_total"] == 1
    by_status = {peer["peer"]: peer for peer in answer["peers"]}
    held = [peer for peer in answer["peers"] if peer["aborted"]]
    assert [peer["replica"] for peer in held] == [f"replica-{holder.host}"]
    assert [peer["status"] for peer in by_status.values()].count("unreachable") == 1
    await client.read_until_cut()


async def test_cli_names_the_replica_that_held_the_request(
    replicas: list[tuple[FakeEngine, TetherProcess]], collected_log: CollectedLog
) -> None:
    """`tether abort <id> --fleet --admin-url <any replica>`: human output naming the holder,
    exit 0; nothing in flight anywhere: exit 1; --json for scripts."""
    (_, first), (engine, holder), _ = replicas
    client = await RawClient.connect(holder.port, host=holder.host)
    await client.send_request(chat_body(max_tokens=100_000), headers={"X-Request-Id": "cli-1"})
    await client.read_until(b"tok0")
    env = {"TETHER_ADMIN_TOKEN": TOKEN}
    admin = first.admin_url("")

    # The CLI blocks; the engines run in this test's event loop, so it runs in a thread.
    done = await asyncio.to_thread(
        run_tether_cli, collected_log, "abort", "cli-1", "--fleet", "--admin-url", admin, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"aborted 'cli-1' on replica-{holder.host} (" + (
        f"{holder.host}:{holder.admin_port})"
    )
    await engine.wait_for(lambda: bool(engine.aborts))

    again = await asyncio.to_thread(
        run_tether_cli,
        collected_log,
        *("abort", "cli-1", "--fleet", "--json", "--admin-url", admin),
        env=env,
    )
    assert again.returncode == 1
    assert json.loads(again.stdout)["aborted_total"] == 0
    await client.read_until_cut()


# --- DNS: every address of a headless Service name -----------------------------------------------


def _can_fake_hosts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, check=False)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_fake_hosts(), reason="needs root and unshare (a private /etc/hosts)")
async def test_fleet_dns_name_resolves_to_every_replica(
    fake_engine: FakeEngineFactory,
    collected_log: CollectedLog,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    """TETHER_FLEET_DNS names all replicas through the system resolver: a name with three
    addresses in a private /etc/hosts (the process's own mount namespace), not a mock."""
    admin_port = free_port()
    addresses = ["127.0.0.6", "127.0.0.7", "127.0.0.8"]
    hosts = tmp_path / "hosts"
    system_hosts = await asyncio.to_thread(Path("/etc/hosts").read_text)
    entries = "".join(f"{a} tether-admin.fleet.test\n" for a in addresses)
    await asyncio.to_thread(hosts.write_text, system_hosts + entries)
    processes = []
    engines = []
    try:
        for address in addresses:
            engine, engine_url = await fake_engine(token_interval=0.01)
            engines.append(engine)
            processes.append(
                await start_tether_process(
                    engine_url,
                    collected_log,
                    {
                        "TETHER_ADMIN_TOKEN": TOKEN,
                        "TETHER_ADMIN_PORT": str(admin_port),
                        "TETHER_REPLICA_NAME": f"replica-{address}",
                        "TETHER_FLEET_DNS": "tether-admin.fleet.test",
                    },
                    host=address,
                    prefix=(
                        "unshare",
                        "--mount",
                        "sh",
                        "-c",
                        f'mount --bind "{hosts}" /etc/hosts && exec "$0" "$@"',
                    ),
                )
            )
        holder = processes[2]
        client = await RawClient.connect(holder.port, host=holder.host)
        await client.send_request(chat_body(max_tokens=100_000), headers={"X-Request-Id": "dns-1"})
        await client.read_until(b"tok0")
        async with http.post(
            processes[0].admin_url("/admin/abort"),
            json={"request_id": "dns-1", "scope": "fleet"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as response:
            answer = await response.json()
        # Every record was asked; the asking replica's own address is recognised and left out.
        assert sorted(peer["peer"] for peer in answer["peers"]) == [
            f"{a}:{admin_port}" for a in addresses[1:]
        ]
        assert answer["aborted_total"] == 1
        await engines[2].wait_for(lambda: bool(engines[2].aborts))
    finally:
        for process in processes:
            await process.close()


# --- router compatibility ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/metrics", "/health", "/v1/models", "/version"])
async def test_router_probes_reach_the_engine_untouched(
    upstream_app: UpstreamAppFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    path: str,
) -> None:
    """The endpoint picker and production-stack scrape the engine's /metrics and probe its
    health on the pod's serving port: through tether they get the engine's own answer, byte
    for byte, and tether counts them under their own route label, not as generation."""
    seen: list[str] = []
    answers = {
        "/metrics": ("vllm:num_requests_running 0\n", "text/plain; version=0.0.4"),
        "/health": ("", "text/plain"),
        "/v1/models": ('{"object":"list","data":[{"id":"tiny"}]}', "application/json"),
        "/version": ('{"version":"0.32.0"}', "application/json"),
    }

    async def answer(request: web.Request) -> web.Response:
        if "X-Forwarded-Proto" in request.headers:  # proxied, not tether's own health check
            seen.append(request.path)
        text, content_type = answers[request.path]
        return web.Response(body=text.encode(), headers={"Content-Type": content_type})

    app = web.Application()
    app.router.add_get(path, answer)
    server = await tether(await upstream_app(app))
    async with http.get(url(server, path)) as response:
        assert response.status == 200
        assert await response.read() == answers[path][0].encode()
        assert response.headers["Content-Type"] == answers[path][1]
    assert seen == [path]
    await settled(server)
    registry = server.context.metrics.registry
    assert metric(registry, "tether_requests_total", route=path, status_class="2xx") == 1


async def test_router_headers_pass_both_ways_untouched(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """W3C trace context, gateway, override and unknown x-* headers reach the engine as sent
    (tracing is off), and the engine's come back the same way."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url)
    sent = {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "tracestate": "congo=t61rcWkgMzE",
        "x-gateway-destination-endpoint": "10.0.0.7:8000",
        "x-override-model": "tiny",
        "x-llm-d-whatever": "kept",
    }
    async with http.post(url(server, "/echo/headers"), json={}, headers=sent) as response:
        echoed = (await response.json())["headers"]
    lowered = {name.lower(): value for name, value in echoed.items()}
    assert {name: lowered[name] for name in sent} == sent


async def test_sglang_override_rid_header_is_tethers_own(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """SGLang takes `X-Override-Rid` over the body's rid when header overrides are on: a
    client's own would defeat tether's unique rids, so tether sets it to its rid."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, engine="sglang")
    async with http.post(
        url(server, "/echo/rid"), json={}, headers={"X-Override-Rid": "victim"}
    ) as response:
        echoed = (await response.json())["headers"]
    [state_rid] = [value for name, value in echoed.items() if name.lower() == "x-override-rid"]
    assert state_rid != "victim" and len(state_rid) == 32


async def test_admin_port_is_not_the_serving_port(
    fake_engine: FakeEngineFactory, tether: TetherFactory, http: aiohttp.ClientSession
) -> None:
    """tether's own /metrics lives on the admin port; the serving port's /metrics is the
    engine's (the fake engine has none: its 404 passes through)."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url)
    async with http.get(admin_url(server, "/metrics")) as response:
        assert "tether_requests_total" in await response.text()
    async with http.get(url(server, "/metrics")) as response:
        assert response.status == 404
