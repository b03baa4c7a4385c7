"""The cause of every cut: each client request cut before its answer was complete is counted
by route and cause (FIN, RST, a failed write, tether's own timeouts by their setting) with
its age, and cuts of one route that keep falling at the same age are said once, as the idle
timeout of something in front of tether."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric

from proxy.observe.cut_clusters import CutClusters
from proxy.observe.cuts import CutCause, LostConnections, cause_of_loss
from proxy.observe.metrics import Metrics
from proxy.server.runner import TetherServer
from proxy.workers.metrics_sum import parse, summed
from tether_fake_engine import GenerationState

from .support.chat import chat_body
from .support.collected_log import IN_PROCESS, CollectedLog
from .support.in_process import TetherFactory, settled
from .support.metrics import metric
from .support.packets import can_drop_packets, silenced
from .support.raw_http import RawClient
from .support.upstreams import FakeEngineFactory

CHAT = "/v1/chat/completions"
Events = list[MutableMapping[str, Any]]  # structlog's captured events


def _cuts(server: TetherServer, cause: str, route: str = CHAT) -> float:
    return metric(
        server.context.metrics.registry,
        "tether_client_cut_age_seconds_count",
        route=route,
        cause=cause,
    )


def _all_cuts(server: TetherServer) -> dict[str, float]:
    """Every cause counted so far, with its count."""
    counts: dict[str, float] = {}
    for family in server.context.metrics.registry.collect():
        for sample in family.samples:
            if sample.name == "tether_client_cut_age_seconds_count":
                counts[sample.labels["cause"]] = sample.value
    return counts


@pytest.fixture
def tether_events(collected_log: CollectedLog) -> Iterator[Events]:
    """The events tether logs meanwhile (added to the collected log at the end)."""
    with structlog.testing.capture_logs() as events:
        yield events
    collected_log.add_lines(IN_PROCESS, "\n".join(repr(event) for event in events))


# --- the socket says why --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("close", "cause"), [("fin", "client_closed"), ("rst", "client_reset")], ids=["fin", "rst"]
)
async def test_a_clients_close_is_counted_by_how_it_closed(
    fake_engine: FakeEngineFactory, tether: TetherFactory, close: str, cause: str
) -> None:
    """A client that closes its stream (FIN) or resets it (RST) while the engine is silent
    is counted as exactly that, at the age it left."""
    _, engine_url = await fake_engine(token_interval=5.0)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100))
    await client.read_until(b"tok0")

    client.close(close)

    await settled(server)
    assert _all_cuts(server) == {cause: 1}
    age_sum = metric(
        server.context.metrics.registry,
        "tether_client_cut_age_seconds_sum",
        route=CHAT,
        cause=cause,
    )
    assert 0 < age_sum < 5.0


async def test_a_client_that_vanishes_while_tether_writes_is_counted_as_a_reset(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client gone while its stream is being written (RST into a busy stream) is counted
    as a reset: whether tether's write or its read meets the reset first, the event loop
    names it before the request's handler hears of the cut, so it is never `write_failed`."""
    _, engine_url = await fake_engine(token_interval=0.0005)
    server = await tether(engine_url)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=1_000_000))
    await client.read_until(b"tok200")

    client.close_rst()

    await settled(server)
    assert _all_cuts(server) == {"client_reset": 1}


@pytest.mark.skipif(not can_drop_packets(), reason="needs root and a working iptables")
@pytest.mark.timeout(30)
async def test_a_client_gone_silent_is_counted_as_a_keepalive_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client that vanishes without a FIN or RST while its engine is silent is found by
    tether's TCP keepalive (idle 1 s here, 3 probes 1 s apart) and counted as
    `keepalive_timeout`, at about that age; its engine work is stopped."""
    engine, engine_url = await fake_engine(token_interval=30.0)
    server = await tether(engine_url, tcp_keepalive_idle=1)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100))
    await client.read_until(b"tok0")
    [internal_id] = engine.generations

    with silenced(client, server.port):
        await engine.wait_for(
            lambda: engine.generation(internal_id).state is GenerationState.ABORTED, timeout=15
        )
    client.close_fin()  # (its socket is gone already: tether's kernel reset it)

    await settled(server)
    assert _all_cuts(server) == {"keepalive_timeout": 1}
    age = metric(
        server.context.metrics.registry,
        "tether_client_cut_age_seconds_sum",
        route=CHAT,
        cause="keepalive_timeout",
    )
    # Keepalive's verdict takes 1 + 3 x 1 s after the last byte.
    assert 3.0 <= age < 4.0 + 2.0


# --- tether's own timeouts ------------------------------------------------------------------


async def test_tethers_stream_idle_timeout_is_counted_by_its_setting(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A stream tether cuts because the engine went silent is counted as
    `stream_idle_timeout`, not as the client leaving."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, stream_idle_timeout=0.3)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=100, stall_after=3))

    await client.read_until_cut()

    await settled(server)
    assert _all_cuts(server) == {"stream_idle_timeout": 1}
    [internal_id] = engine.generations
    await engine.wait_for(lambda: engine.generation(internal_id).state is GenerationState.ABORTED)


async def test_tethers_request_timeout_is_counted_by_its_setting(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A request tether ends at TETHER_REQUEST_TIMEOUT is counted as `request_timeout`."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, request_timeout=0.3)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(stream=False, prefill=30))

    reply = await client.read_reply()

    assert reply.status == 504
    await settled(server)
    assert _all_cuts(server) == {"request_timeout": 1}


async def test_a_silent_uploader_is_counted_as_client_body_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory
) -> None:
    """A client that stops sending its body is cut at TETHER_CLIENT_BODY_TIMEOUT, counted as
    `client_body_timeout`."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url, client_body_timeout=0.3)
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(), body_bytes_now=10)

    reply = await client.read_reply()

    assert reply.status == 408
    await settled(server)
    assert _all_cuts(server) == {"client_body_timeout": 1}


# --- the same age, again and again ----------------------------------------------------------

CUT_AFTER = 1.2  # each client's own deadline on its stream
STREAMS = 5


async def _stream_until_deadline(server: TetherServer) -> None:
    """A stream whose client gives up on it CUT_AFTER seconds after sending it (FIN)."""
    client = await RawClient.connect(server.port)
    await client.send_request(chat_body(max_tokens=1000))
    with pytest.raises(TimeoutError):
        await client.read_to_end(timeout=CUT_AFTER)
    client.close_fin()


async def test_streams_cut_at_the_same_age_are_reported_once_as_an_idle_timeout(
    fake_engine: FakeEngineFactory, tether: TetherFactory, tether_events: Events
) -> None:
    """Five streams cut at the same age: each cut is counted and logged with its cause, and
    one warning (and one cluster in the metrics) names the route and the age as the likely
    idle timeout of something in front of tether."""
    _, engine_url = await fake_engine(token_interval=0.25)
    server = await tether(engine_url)

    await asyncio.gather(*(_stream_until_deadline(server) for _ in range(STREAMS)))

    await settled(server)
    registry = server.context.metrics.registry
    assert _cuts(server, "client_closed") == STREAMS
    assert metric(registry, "tether_client_cut_clusters_total", route=CHAT) == 1
    cluster_age = metric(registry, "tether_client_cut_cluster_age_seconds", route=CHAT)
    assert abs(cluster_age - CUT_AFTER) <= 0.3
    cuts = [event for event in tether_events if event["event"] == "client_connection_cut"]
    assert [event["cause"] for event in cuts] == ["client_closed"] * STREAMS
    [warning] = [event for event in tether_events if event["event"] == "client_cuts_clustered"]
    assert warning["log_level"] == "warning"
    assert warning["route"] == CHAT
    assert warning["age_seconds"] == cluster_age
    assert warning["cuts"] >= 3
    assert warning["causes"] == ["client_closed"]
    assert f"cuts streams of {CHAT} at {cluster_age} s" in warning["likely_cause"]


# --- without sockets ------------------------------------------------------------------------


@pytest.mark.socket_free
@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (None, CutCause.CLIENT_CLOSED),
        (ConnectionResetError(104, "Connection reset by peer"), CutCause.CLIENT_RESET),
        (BrokenPipeError(32, "Broken pipe"), CutCause.CLIENT_RESET),
        (TimeoutError(110, "Connection timed out"), CutCause.KEEPALIVE_TIMEOUT),
        (OSError(113, "No route to host"), CutCause.CONNECTION_ERROR),
    ],
)
def test_a_lost_connection_is_named_by_what_the_loop_passed(
    exc: BaseException | None, cause: CutCause
) -> None:
    """FIN (None), RST, a broken pipe, unanswered keepalive probes (ETIMEDOUT) and any other
    socket error each have their cause."""
    assert cause_of_loss(exc) is cause


@pytest.mark.socket_free
def test_a_connection_cut_before_the_socket_said_why_is_a_failed_write() -> None:
    """No loss recorded (tether's own write found it closing first): `write_failed`; a
    forgotten connection holds nothing."""
    lost = LostConnections()
    connection = object()
    assert lost.cause(connection) is CutCause.WRITE_FAILED
    lost.lost(connection, None)
    assert lost.cause(connection) is CutCause.CLIENT_CLOSED
    lost.forget(connection)
    assert len(lost) == 0


@pytest.mark.socket_free
def test_three_cuts_at_one_age_make_one_cluster() -> None:
    """The third cut of a route within half a second of the same age reports the cluster
    (its mean age to a tenth, count and causes); the fourth and fifth do not again."""
    clusters = CutClusters()
    found = [
        clusters.add(CHAT, age, cause, now)
        for now, age, cause in [
            (100.0, 60.02, "client_closed"),
            (130.0, 60.11, "client_reset"),
            (170.0, 60.14, "client_closed"),
            (200.0, 60.01, "client_closed"),
            (210.0, 60.3, "client_closed"),
        ]
    ]
    assert found[:2] == [None, None]
    assert found[2] is not None
    assert (found[2].route, found[2].age, found[2].cuts) == (CHAT, 60.1, 3)
    assert found[2].causes == ("client_closed", "client_reset")
    assert found[3:] == [None, None]


@pytest.mark.socket_free
def test_cuts_at_different_ages_make_no_cluster() -> None:
    """Clients leaving whenever they like (ages spread out) are not an idle timeout."""
    clusters = CutClusters()
    assert all(
        clusters.add(CHAT, 2.0 + i * 1.3, "client_closed", float(i)) is None for i in range(30)
    )


@pytest.mark.socket_free
def test_cuts_younger_than_a_second_make_no_cluster() -> None:
    """Clients that change their minds at once are not an idle timeout."""
    clusters = CutClusters()
    assert all(clusters.add(CHAT, 0.2, "client_closed", float(i)) is None for i in range(10))


@pytest.mark.socket_free
def test_a_cluster_is_per_route_and_window() -> None:
    """Cuts of different routes do not add up; a cluster still there after the window is
    reported again; old cuts outside the window do not count."""
    clusters = CutClusters(window=600.0)
    assert clusters.add(CHAT, 15.0, "client_closed", 0.0) is None
    assert clusters.add("/v1/completions", 15.0, "client_closed", 1.0) is None
    assert clusters.add(CHAT, 15.1, "client_closed", 2.0) is None
    assert clusters.add("/v1/completions", 15.1, "client_closed", 3.0) is None
    assert clusters.add(CHAT, 15.2, "client_closed", 4.0) is not None
    assert clusters.add(CHAT, 15.0, "client_closed", 700.0) is None  # the first ones aged out
    assert clusters.add(CHAT, 15.0, "client_closed", 701.0) is None
    assert clusters.add(CHAT, 15.0, "client_closed", 702.0) is not None  # reported again


@pytest.mark.socket_free
def test_a_routes_memory_is_bounded() -> None:
    """However many cuts and clusters a route has (here a new cluster every three cuts), the
    detector keeps a fixed number of them."""
    clusters = CutClusters(ring=32)
    found = 0
    for i in range(10_000):
        found += clusters.add(CHAT, 1.0 + (i // 3) * 1.1, "client_closed", i / 100) is not None
    assert found > 3_000
    assert len(clusters._cuts[CHAT]) == 32
    assert len(clusters._reported[CHAT]) == 32


@pytest.mark.socket_free
def test_with_workers_the_cluster_age_is_the_largest_any_worker_saw() -> None:
    """The supervisor's /metrics shows a cluster's age as a worker measured it (the largest
    when two saw clusters), never the sum of ages; the clusters themselves add up."""
    workers = []
    for age in (15.0, 60.0):
        worker = Metrics()
        worker.record_cut_cluster(CHAT, age)
        workers.append(parse(generate_latest(worker.registry).decode()))
    supervisor = CollectorRegistry()
    supervisor.register(_Summed(list(summed(workers))))
    assert metric(supervisor, "tether_client_cut_cluster_age_seconds", route=CHAT) == 60.0
    assert metric(supervisor, "tether_client_cut_clusters_total", route=CHAT) == 2


class _Summed:
    """The summed families, as a collector a registry reads."""

    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families
