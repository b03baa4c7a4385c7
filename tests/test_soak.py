"""Soak: thousands of concurrent streams with clients leaving at random, several rounds against
the real `tether` process. Nothing missed, nothing extra aborted, nothing leaked.

Run with `python -m pytest -m soak -s` (excluded from the default run).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import resource
import signal
import statistics
import time
from pathlib import Path

import aiohttp
import pytest

from proxy.engines import DEFAULT_ENGINE, PROFILES
from tether_fake_engine import FakeEngine, GenerationState

from .support.chat import chat_body
from .support.processes import TetherProcessFactory
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until

# The process runs in front of the default engine: how long its idle upstream connections last.
KEEPALIVE_SECONDS = PROFILES[DEFAULT_ENGINE].keepalive_seconds
STREAMS = int(os.environ.get("TETHER_SOAK_STREAMS", "2000"))
ROUNDS = int(os.environ.get("TETHER_SOAK_ROUNDS", "3"))


def _raise_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, max(hard, target)))


_ADMIN_TOKEN = "soak-admin-token"
_ADMIN_HEADERS = {"Authorization": f"Bearer {_ADMIN_TOKEN}"}


def _rss_and_fds(pid: int) -> tuple[int, int]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    return rss_kib * 1024, len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.soak
@pytest.mark.timeout(300 * (ROUNDS + 1))  # a round takes well under a minute on 2 cores
async def test_soak_rounds_lose_nothing_and_leak_nothing(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """Each round: STREAMS concurrent streams, about half abandoned at random; every abandoned
    one is aborted, no completed one is, tether ends each round empty, and its RSS and open
    file descriptors do not grow from round to round."""
    _raise_fd_limit(4 * STREAMS + 1024)
    rng = random.Random(2026)
    # 2,000 streams at 4 tokens/s: 8,000 events/s, which the engine, the clients (this
    # process) and tether sustain on 2 cores, so every stream overlaps every other.
    engine, engine_url = await fake_engine(token_interval=0.25)
    process = await tether_process(
        engine_url,
        TETHER_LOG_LEVEL="warning",
        TETHER_ABORT_REPEAT_DELAY="0",
        TETHER_ADMIN_TOKEN=_ADMIN_TOKEN,
    )
    port, admin_port = process.port, process.admin_port
    _, baseline_fds = _rss_and_fds(process.pid)
    rounds: list[dict[str, float]] = []
    try:
        # A warm-up round first: it grows the allocator's heap to the peak load, which Python
        # keeps; the leak check judges the rounds after it.
        warm_up = await _soak_round(engine, process.pid, port, admin_port, "warm-", rng)
        print(f"\nwarm-up: {warm_up}")
        for round_index in range(ROUNDS):
            rounds.append(
                await _soak_round(engine, process.pid, port, admin_port, f"r{round_index}-", rng)
            )
            print(f"\nround {round_index + 1}: {rounds[-1]}")
    finally:
        assert await process.stop(signal.SIGTERM, timeout=60) == 0

    # Each round waited a bounded time for its aborts and counted what never came.
    assert warm_up["missed_aborts"] == 0 and all(r["missed_aborts"] == 0 for r in rounds), (
        f"abandoned streams never aborted: warm-up {warm_up}, rounds {rounds}"
    )
    # Leak check: descriptors back to the idle baseline after every round, and no growth of
    # RSS across the measured rounds beyond allocator noise (a new load peak can still lift
    # the high-water mark a little; a leak grows every round).
    assert all(r["open_fds"] <= baseline_fds + 2 for r in [warm_up, *rounds])
    assert rounds[-1]["rss_mib"] <= rounds[0]["rss_mib"] * 1.10 + 5


async def _soak_round(
    engine: FakeEngine, pid: int, port: int, admin_port: int, prefix: str, rng: random.Random
) -> dict[str, float]:
    closed_at: dict[str, float] = {}  # client ID -> when it left
    completed_clients: set[str] = set()
    stuck: dict[str, str] = {}  # client ID -> what its read ended with
    connecting = asyncio.Semaphore(256)  # a ramp, not a SYN flood: streams still overlap

    async def stream(index: int) -> None:
        client_id = f"{prefix}{index}"
        abandon = rng.random() < 0.5
        async with connecting:
            client = await RawClient.connect(port)
        body = chat_body(max_tokens=100_000 if abandon else rng.randrange(3, 12))
        body["user"] = client_id  # lets the test match engine-side IDs to clients
        await client.send_request(body, headers={"X-Request-Id": client_id})
        marker = f'tok{rng.randrange(0, 6)}"'.encode() if abandon else b"data: [DONE]\n\n"
        try:
            await client.read_until(marker, timeout=60)
        except (TimeoutError, asyncio.IncompleteReadError) as exc:
            stuck[client_id] = repr(exc)
            client.close_rst()
            return
        if abandon:
            closed_at[client_id] = time.monotonic()
            client.close("fin" if rng.random() < 0.5 else "rst")
        else:
            completed_clients.add(client_id)
            client.close_fin()

    await asyncio.gather(*(stream(i) for i in range(STREAMS)))
    if stuck:
        await _explain_stuck(engine, admin_port, stuck)
    internal_of = {
        json.loads(request.body)["user"]: request.headers["X-Request-Id"]
        for request in engine.requests
        if json.loads(request.body)["user"].startswith(prefix)
    }
    assert len(internal_of) == STREAMS
    abandoned = {internal_of[client_id] for client_id in closed_at}
    try:
        await engine.wait_for(lambda: engine.aborted_ids() >= abandoned, 30)
    except TimeoutError:
        pass  # what is still missing now is counted as missed, below
    missed = abandoned - engine.aborted_ids()
    await _wait_idle(admin_port)

    assert engine.aborted_ids() & set(internal_of.values()) <= abandoned  # nothing extra
    for client_id in completed_clients:
        assert engine.generation(internal_of[client_id]).state is GenerationState.COMPLETED
    first_abort: dict[str, float] = {}
    for abort in engine.aborts:
        for engine_id in abort.ids:
            first_abort.setdefault(engine_id.removeprefix("chatcmpl-"), abort.at)
    latencies = sorted(
        first_abort[internal_of[c]] - t
        for c, t in closed_at.items()
        if internal_of[c] in first_abort
    ) or [float("nan")]
    # Idle keep-alive connections to the engine are closed by a periodic sweep, within
    # twice their timeout; only then does the descriptor count say what leaked.
    await asyncio.sleep(2 * KEEPALIVE_SECONDS + 1)
    rss, fds = _rss_and_fds(pid)
    return {
        "streams": STREAMS,
        "abandoned": len(abandoned),
        "missed_aborts": len(missed),
        "completed": len(completed_clients),
        "rss_mib": round(rss / 2**20, 1),
        "open_fds": fds,
        "abort_p50_ms": round(statistics.median(latencies) * 1000, 2),
        "abort_p99_ms": round(latencies[int(len(latencies) * 0.99)] * 1000, 2),
        "abort_max_ms": round(latencies[-1] * 1000, 2),
    }


async def _explain_stuck(engine: FakeEngine, admin_port: int, stuck: dict[str, str]) -> None:
    """Fail with what the engine and tether knew of each stream that never finished."""
    internal_of = {
        json.loads(request.body)["user"]: request.headers["X-Request-Id"]
        for request in engine.requests
    }
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(
            f"http://127.0.0.1:{admin_port}/admin/requests", headers=_ADMIN_HEADERS
        ) as response:
            in_flight = {r["client_request_id"]: r for r in (await response.json())["requests"]}
    lines = []
    for client_id, error in list(stuck.items())[:20]:
        internal = internal_of.get(client_id)
        generation = engine.generations.get(internal) if internal else None
        lines.append(
            f"{client_id}: {error}; engine: "
            f"{(generation.state, generation.produced) if generation else 'never saw it'}; "
            f"tether: {in_flight.get(client_id, 'not in flight')}"
        )
    raise AssertionError(f"{len(stuck)} streams never finished:\n" + "\n".join(lines))


async def _wait_idle(admin_port: int) -> None:
    """Until tether's in-flight list is empty (polled, like an operator would)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

        async def idle() -> bool:
            async with session.get(
                f"http://127.0.0.1:{admin_port}/admin/requests", headers=_ADMIN_HEADERS
            ) as response:
                return bool((await response.json())["requests"] == [])

        await poll_until(idle, 30, interval=0.1, what="tether's in-flight list to empty")
