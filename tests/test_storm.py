"""Many concurrent streams, half abandoned at random moments: every abandoned request is
aborted upstream, no completed one is, and tether forgets them all."""

from __future__ import annotations

import asyncio
import random
import statistics
import time

from proxy.fake_engine import GenerationState

from .conftest import RawClient, chat_body

STREAMS = 200


async def test_storm_of_streams_half_abandoned(fake_engine, tether) -> None:
    """200 concurrent streams, 100 abandoned (FIN or RST) after a random number of tokens."""
    rng = random.Random(7)
    engine, engine_url = await fake_engine(token_interval=0.02)
    server = await tether(engine_url)
    closed_at: dict[str, float] = {}  # internal ID -> when its client left

    async def stream(index: int) -> None:
        client_id = f"storm-{index}"
        abandon = index % 2 == 0
        client = await RawClient.connect(server.port)
        max_tokens = 100_000 if abandon else 30
        await client.send_request(
            chat_body(max_tokens=max_tokens), headers={"X-Request-Id": client_id}
        )
        if not abandon:
            await asyncio.wait_for(client.reader.readuntil(b"data: [DONE]\n\n"), 30)
            client.close_fin()
            return
        await client.read_until(f'tok{rng.randrange(0, 20)}"'.encode())
        [state] = server.context.registry.find(client_id)
        closed_at[state.internal_request_id] = time.monotonic()
        client.close_fin() if rng.random() < 0.5 else client.close_rst()

    await asyncio.gather(*(stream(i) for i in range(STREAMS)))
    await engine.wait_for(lambda: engine.aborted_ids() >= set(closed_at), timeout=20)
    async with asyncio.timeout(10):
        await server.context.registry.wait_empty()
    await server.context.aborts.drain()

    assert len(closed_at) == STREAMS // 2
    assert engine.aborted_ids() == set(closed_at)  # every abandoned one, nothing else
    completed = {
        g.request_id for g in engine.generations.values() if g.state is GenerationState.COMPLETED
    }
    assert len(completed) == STREAMS // 2
    first_abort: dict[str, float] = {}
    for abort in engine.aborts:
        for engine_id in abort.ids:
            first_abort.setdefault(engine_id.removeprefix("chatcmpl-"), abort.at)
    latencies = sorted(first_abort[i] - closed_at[i] for i in closed_at)
    metrics = server.context.metrics
    assert (
        sum(
            metrics.client_disconnects.labels(p)._value.get()
            for p in ("body", "waiting", "streaming")
        )
        == STREAMS // 2
    )
    assert metrics.aborts.labels("vllm", "ok")._value.get() == STREAMS // 2
    print(
        f"\ndisconnect -> engine abort over {len(latencies)} abandoned streams: "
        f"median {statistics.median(latencies) * 1000:.2f} ms, "
        f"p90 {latencies[int(len(latencies) * 0.9)] * 1000:.2f} ms, "
        f"worst {latencies[-1] * 1000:.2f} ms"
    )
