"""The load generator: a separate process that drives one workload and prints JSON.

It reads a spec (JSON) on stdin. Clients are raw asyncio protocols on uvloop, the cheapest
correct client we can write, because the generator shares a core with the engine. It also
samples the proxy's CPU and memory itself, so the measurement window is exactly the window
in which events were counted.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import uvloop

from bench.engine import ID_RULES, MODEL
from bench.http1 import BodyDecoder, body_decoder, parse_head
from bench.procstat import busy_seconds_per_core, cpu_seconds, rss_bytes
from bench.stats import summarize_us
from bench.systems import CLIENT_CORE, PROXY_CORE

STAMP = re.compile(rb'"bench_ts":(\d+)')
DONE = b"data: [DONE]\n\n"
CONNECT_CONCURRENCY = 64  # stays below the default listen backlog of an aiohttp server


@dataclass(slots=True)
class Meter:
    """Counters shared by every client; only the measurement window counts."""

    measuring: bool = False
    sent: int = 0  # every request written, warm-up included: each should leave a span
    events: int = 0
    requests: int = 0
    errors: int = 0
    id_mismatches: int = 0
    # Usage events a client that never asked for usage received: tether asks the engine for
    # them and must take them out.
    usage_leaked: int = 0
    latencies_ns: list[int] = field(default_factory=list)
    record_latency: bool = False


class EventSink:
    """Splits one SSE response into events, counts them and checks the mapped-back ID."""

    def __init__(self, meter: Meter, expected_id: bytes) -> None:
        self._meter = meter
        self._expected_id = expected_id
        self._pending = b""
        self.first_event: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def feed(self, payload: bytes, now_ns: int) -> None:
        data = self._pending + payload if self._pending else payload
        end = data.rfind(b"\n\n")
        if end < 0:
            self._pending = data
            return
        complete, self._pending = data[: end + 2], data[end + 2 :]
        if not self.first_event.done():
            self.first_event.set_result(None)
            if self._expected_id not in complete:
                self._meter.id_mismatches += 1
        meter = self._meter
        if b'"usage":' in complete:
            meter.usage_leaked += 1
        if not meter.measuring:
            return
        count = complete.count(b"\n\n")
        meter.events += count - 1 if complete.endswith(DONE) else count
        if meter.record_latency:
            meter.latencies_ns.extend(now_ns - int(stamp) for stamp in STAMP.findall(complete))


class BodySink:
    """Collects a small JSON body and checks the mapped-back ID."""

    def __init__(self, meter: Meter, expected_id: bytes) -> None:
        self._meter = meter
        self._expected_id = expected_id
        self._parts: list[bytes] = []

    def feed(self, payload: bytes, now_ns: int) -> None:
        self._parts.append(payload)

    def check(self) -> None:
        if self._expected_id not in b"".join(self._parts):
            self._meter.id_mismatches += 1


Sink = EventSink | BodySink


class ClientConnection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self) -> None:
        self._buffer = b""
        self._body: BodyDecoder | None = None
        self._sink: Sink | None = None
        self._status = 0
        self._done: asyncio.Future[int] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def send(self, raw: bytes, sink: Sink) -> asyncio.Future[int]:
        """Write a request; the future gets the status once the whole response has arrived."""
        self._sink = sink
        self._done = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self._done

    def data_received(self, data: bytes) -> None:
        now_ns = time.monotonic_ns()
        if self._body is None:
            self._buffer += data
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = parse_head(self._buffer[:end])
            self._status = int(head.start[1])
            self._body = body_decoder(head.headers, is_response=True)
            data, self._buffer = self._buffer[end + 4 :], b""
        payload, rest = self._body.feed(data)
        assert self._sink is not None
        if payload:
            self._sink.feed(payload, now_ns)
        if rest is not None:
            self._body = None
            assert self._done is not None
            self._done.set_result(self._status)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(ConnectionResetError("connection closed mid-response"))


class Client:
    """Builds requests for one target and opens connections to it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self._host = spec["host"]
        self._port = spec["port"]
        self._path = spec.get("path", "/v1/chat/completions")
        self._ids = ID_RULES[self._path.encode()]  # the `id` the engine answers with
        self._connect_slots = asyncio.Semaphore(CONNECT_CONCURRENCY)

    async def connect(self) -> ClientConnection:
        async with self._connect_slots:
            _, conn = await asyncio.get_running_loop().create_connection(
                ClientConnection, self._host, self._port
            )
        return conn

    def request(
        self, client_request_id: str, *, stream: bool, knobs: dict[str, Any] | None = None
    ) -> tuple[bytes, bytes]:
        """The raw request and the ID the response must carry after mapping back. `knobs`
        tell the engine how to stream (the body's `bench` member: a router such as smg
        forwards unknown body members, but neither the query nor unknown headers)."""
        document: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": stream,
        }
        if knobs:
            document["bench"] = knobs
        body = json.dumps(document, separators=(",", ":")).encode()
        raw = (
            f"POST {self._path} HTTP/1.1\r\nhost: {self._host}:{self._port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"x-request-id: {client_request_id}\r\n\r\n"
        ).encode() + body
        return raw, f'"id":"{self._ids.answer(client_request_id)}"'.encode()


@dataclass(slots=True)
class Snapshot:
    wall_ns: int
    proxy_cpu_s: float
    engine_cpu_s: float
    loadgen_cpu_s: float
    core_busy_s: list[float]


def snapshot(spec: dict[str, Any]) -> Snapshot:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    proxy_pid = spec.get("proxy_pid")
    return Snapshot(
        wall_ns=time.monotonic_ns(),
        proxy_cpu_s=cpu_seconds(proxy_pid) if proxy_pid else 0.0,
        engine_cpu_s=cpu_seconds(spec["engine_pid"]),
        loadgen_cpu_s=usage.ru_utime + usage.ru_stime,
        core_busy_s=busy_seconds_per_core(),
    )


async def measure(spec: dict[str, Any], meter: Meter) -> dict[str, Any]:
    """Warm up, then count for the window; returns the window's wall and CPU figures."""
    await asyncio.sleep(spec["warmup_s"])
    start = snapshot(spec)
    meter.measuring = True
    await asyncio.sleep(spec["window_s"])
    meter.measuring = False
    end = snapshot(spec)
    wall_s = (end.wall_ns - start.wall_ns) / 1e9
    proxy_cpu_s = end.proxy_cpu_s - start.proxy_cpu_s
    engine_cpu_s = end.engine_cpu_s - start.engine_cpu_s
    loadgen_cpu_s = end.loadgen_cpu_s - start.loadgen_cpu_s
    busy = [
        after - before for before, after in zip(start.core_busy_s, end.core_busy_s, strict=True)
    ]
    return {
        "wall_s": wall_s,
        "proxy_cpu_s": proxy_cpu_s,
        "engine_cpu_s": engine_cpu_s,
        "loadgen_cpu_s": loadgen_cpu_s,
        # Work of other processes on our cores during the window: the noise in the figures.
        "foreign_share_proxy_core": max(0.0, busy[PROXY_CORE] - proxy_cpu_s) / wall_s,
        "foreign_share_client_core": max(0.0, busy[CLIENT_CORE] - engine_cpu_s - loadgen_cpu_s)
        / wall_s,
    }


def counters(meter: Meter) -> dict[str, Any]:
    return {
        "sent": meter.sent,
        "events": meter.events,
        "requests": meter.requests,
        "errors": meter.errors,
        "id_mismatches": meter.id_mismatches,
        "usage_leaked": meter.usage_leaked,
    }


async def finish(tasks: list[asyncio.Task[None]], timeout_s: float) -> int:
    """Let in-flight requests end on their own; returns how many had to be cancelled."""
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return len(pending)


async def run_streams(spec: dict[str, Any]) -> dict[str, Any]:
    """Workloads 1 and 2: N streams back to back, saturating (rate 0) or paced."""
    client, meter = Client(spec), Meter(record_latency=spec["rate"] > 0)
    stop = asyncio.Event()
    knobs = {"events": spec["events"], "rate": spec["rate"]}

    async def worker(index: int) -> None:
        conn = await client.connect()
        if spec["rate"] > 0:
            # Random phases, as independent requests have, instead of bursts of N events.
            await asyncio.sleep(random.uniform(0, 1 / spec["rate"]))
        sequence = 0
        while not stop.is_set():
            raw, expected_id = client.request(f"bench-{index}-{sequence}", stream=True, knobs=knobs)
            sequence += 1
            meter.sent += 1
            try:
                status = await conn.send(raw, EventSink(meter, expected_id))
            except ConnectionError:
                meter.errors += 1
                return
            meter.errors += status != 200
            meter.requests += meter.measuring  # streams that ended inside the window
        conn.transport.close()

    tasks = [asyncio.create_task(worker(i)) for i in range(spec["streams"])]
    window = await measure(spec, meter)
    stop.set()
    cancelled = await finish(tasks, timeout_s=10)
    return (
        window
        | counters(meter)
        | {
            "cancelled_at_end": cancelled,
            "latency_us": summarize_us(meter.latencies_ns),
        }
    )


async def run_requests(spec: dict[str, Any]) -> dict[str, Any]:
    """Workload 3: closed-loop clients sending small non-streaming requests."""
    client, meter = Client(spec), Meter()
    stop = asyncio.Event()
    latencies_ns: list[int] = []

    async def worker(index: int) -> None:
        conn = await client.connect()
        sequence = 0
        while not stop.is_set():
            raw, expected_id = client.request(f"bench-{index}-{sequence}", stream=False)
            sequence += 1
            meter.sent += 1
            sink = BodySink(meter, expected_id)
            started_ns = time.monotonic_ns()
            try:
                status = await conn.send(raw, sink)
            except ConnectionError:
                meter.errors += 1
                return
            if meter.measuring:
                latencies_ns.append(time.monotonic_ns() - started_ns)
                meter.requests += 1
            meter.errors += status != 200
            sink.check()
        conn.transport.close()

    tasks = [asyncio.create_task(worker(i)) for i in range(spec["clients"])]
    window = await measure(spec, meter)
    stop.set()
    await finish(tasks, timeout_s=10)
    return window | counters(meter) | {"latency_us": summarize_us(latencies_ns)}


async def run_aborts(spec: dict[str, Any]) -> dict[str, Any]:
    """Workload 4: open every stream, measure the relay's pace, then each client leaves at a
    random moment."""
    client, meter = Client(spec), Meter()
    opened: list[tuple[str, ClientConnection, asyncio.Future[int]]] = []
    failed = 0

    async def open_stream(index: int) -> None:
        nonlocal failed
        tag = f"s{index}"
        raw, expected_id = client.request(
            f"bench-abort-{index}",
            stream=True,
            knobs={"events": 1_000_000, "rate": spec["rate"], "tag": tag},
        )
        try:
            conn = await client.connect()
            sink = EventSink(meter, expected_id)
            meter.sent += 1
            response = conn.send(raw, sink)
            await asyncio.wait_for(sink.first_event, spec["open_timeout_s"])
        except (OSError, TimeoutError):
            failed += 1
            return
        opened.append((tag, conn, response))

    await asyncio.gather(*(open_stream(i) for i in range(spec["streams"])))
    # The load the aborts meet: a proxy that cannot keep this pace queues events, and the
    # engine, held back by the full socket, sends fewer than it was asked to.
    window = await measure(spec, meter)
    loop = asyncio.get_running_loop()
    closed_ns: dict[str, int] = {}
    ended_early = 0

    def disconnect(tag: str, conn: ClientConnection, response: asyncio.Future[int]) -> None:
        nonlocal ended_early
        if response.done():
            ended_early += 1  # the stream ended before its client left: not a disconnect
            return
        response.cancel()
        closed_ns[tag] = time.monotonic_ns()
        conn.transport.close()

    for tag, conn, response in opened:
        loop.call_later(random.uniform(0, spec["spread_s"]), disconnect, tag, conn, response)
    await asyncio.sleep(spec["spread_s"] + 0.1)
    return (
        window
        | counters(meter)
        | {
            "opened": len(opened),
            "failed_to_open": failed,
            "ended_early": ended_early,
            "closed_ns": closed_ns,
        }
    )


async def run_idle(spec: dict[str, Any]) -> dict[str, Any]:
    """Workload 5: hold idle streams open and read the proxy's RSS at each step."""
    client, meter = Client(spec), Meter()
    streams: list[tuple[ClientConnection, asyncio.Future[int], EventSink]] = []
    failed = 0

    async def open_stream(index: int) -> None:
        nonlocal failed
        raw, expected_id = client.request(
            f"bench-idle-{index}", stream=True, knobs={"events": 2, "hold": True}
        )
        try:
            conn = await client.connect()
            sink = EventSink(meter, expected_id)
            meter.sent += 1
            streams.append((conn, conn.send(raw, sink), sink))
            await asyncio.wait_for(sink.first_event, spec["open_timeout_s"])
        except (OSError, TimeoutError):
            failed += 1

    steps = []
    proxy_pid = spec.get("proxy_pid")
    for target in spec["steps"]:
        await asyncio.gather(*(open_stream(i) for i in range(len(streams) + failed, target)))
        await asyncio.sleep(spec["settle_s"])
        steps.append(
            {
                "target": target,
                "open": sum(
                    sink.first_event.done() and not response.done() for _, response, sink in streams
                ),
                "proxy_rss": rss_bytes(proxy_pid) if proxy_pid else None,
                "engine_rss": rss_bytes(spec["engine_pid"]),
            }
        )
    for conn, response, _ in streams:
        response.cancel()
        conn.transport.close()
    return counters(meter) | {"failed_to_open": failed, "steps": steps}


MODES = {"streams": run_streams, "requests": run_requests, "aborts": run_aborts, "idle": run_idle}


def main() -> None:
    spec = json.load(sys.stdin)
    result = uvloop.run(MODES[spec["mode"]](spec))
    json.dump(result, sys.stdout)


if __name__ == "__main__":
    main()
