"""TETHER_WORKERS: worker processes share the client port under a supervisor whose admin port
answers for all of them, restarts a worker that dies, drains them all on SIGTERM, and leaves
none behind when it is killed itself."""

from __future__ import annotations

import asyncio
import fcntl
import os
import signal
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proxy.observe.metrics import Metrics
from proxy.server.siblings import private_directory_problem
from proxy.workers import runtime as supervisor_runtime
from proxy.workers.cpus import cgroup_quota_cpus, usable_cpus
from tether_fake_engine import GenerationState

from .support.chat import chat_body
from .support.collected_log import CollectedLog
from .support.metrics import metric_in_text
from .support.net import free_port
from .support.processes import TetherProcess, TetherProcessFactory, run_tether_cli
from .support.raw_http import RawClient, request_with_header_bytes
from .support.upstreams import FakeEngineFactory
from .support.waiting import poll_until

TOKEN = "workers-test-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
TWO_WORKERS = {"TETHER_WORKERS": "2", "TETHER_ADMIN_TOKEN": TOKEN}
# Connections the kernel hashes onto the workers; this many land on both unless something
# pins them to one (a chance of 2 in 2^32).
MAX_CONNECTIONS = 32


@dataclass
class Stream:
    client: RawClient
    client_request_id: str
    worker: int
    internal_request_id: str


async def _in_flight(process: TetherProcess, http: aiohttp.ClientSession) -> list[dict[str, Any]]:
    async with http.get(process.admin_url("/admin/requests"), headers=ADMIN) as response:
        assert response.status == 200
        answer = await response.json()
    assert "worker_errors" not in answer
    entries: list[dict[str, Any]] = answer["requests"]
    return entries


async def _open_stream(
    process: TetherProcess, http: aiohttp.ClientSession, request_id: str, max_tokens: int
) -> Stream:
    """A stream on a new connection, once its first token arrived, and where it landed."""
    client = await RawClient.connect(process.port)
    await client.send_request(
        chat_body(max_tokens=max_tokens), headers={"X-Request-Id": request_id}
    )
    first = await client.read_until(b"tok0")
    # The client sees its own ID, whichever worker served it.
    assert f'"id":"chatcmpl-{request_id}"'.encode() in first
    [entry] = [e for e in await _in_flight(process, http) if e["client_request_id"] == request_id]
    return Stream(client, request_id, entry["worker"], entry["internal_request_id"])


async def _streams_on_both_workers(
    process: TetherProcess, http: aiohttp.ClientSession, prefix: str, max_tokens: int
) -> list[Stream]:
    """Streams on new connections until both workers hold at least one."""
    streams: list[Stream] = []
    while {stream.worker for stream in streams} != {0, 1}:
        assert len(streams) < MAX_CONNECTIONS, "every connection landed on one worker"
        streams.append(await _open_stream(process, http, f"{prefix}-{len(streams)}", max_tokens))
    return streams


async def _metrics(process: TetherProcess, http: aiohttp.ClientSession) -> str:
    async with http.get(process.admin_url("/metrics")) as response:
        assert response.status == 200
        return await response.text()


async def _readiness(process: TetherProcess, http: aiohttp.ClientSession) -> tuple[int, Any]:
    async with http.get(process.admin_url("/readyz")) as response:
        return response.status, await response.json()


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


async def test_connections_are_spread_over_both_workers_and_ids_map_back(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """Both workers serve the one client port; each stream shows the client its own ID while
    the engine runs tether's internal one, and each worker's log lines name it."""
    engine, engine_url = await fake_engine(token_interval=0.02)
    process = await tether_process(engine_url, **TWO_WORKERS)
    streams = await _streams_on_both_workers(process, http, "spread", max_tokens=100_000)

    internal_ids = {stream.internal_request_id for stream in streams}
    assert internal_ids == set(engine.generations)
    assert not internal_ids & {stream.client_request_id for stream in streams}
    for stream in streams:
        stream.client.close("fin")
    await engine.wait_for(lambda: engine.aborted_ids() == internal_ids)
    for stream in streams:
        line = await process.wait_event(
            "request_finished", client_request_id=stream.client_request_id
        )
        assert line["worker"] == stream.worker


async def test_metrics_are_the_sum_over_workers(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """After K requests on K connections (both workers served some), the supervisor's
    request counter says K; it exposes every metric one tether does, with the same type,
    and its own: workers running, restarts."""
    _, engine_url = await fake_engine(max_tokens=2)
    process = await tether_process(engine_url, **TWO_WORKERS)
    requests, served_by = 0, set[int]()
    connector = aiohttp.TCPConnector(force_close=True)  # a new connection per request
    async with aiohttp.ClientSession(connector=connector) as fresh:
        while requests < 12 or served_by != {0, 1}:
            assert requests < MAX_CONNECTIONS, "every connection landed on one worker"
            request_id = f"sum-{requests}"
            headers = {"X-Request-Id": request_id}
            async with fresh.post(process.url(), json=chat_body(stream=False), headers=headers):
                pass
            requests += 1
            line = await process.wait_event("request_finished", client_request_id=request_id)
            assert line["status"] == 200
            served_by.add(line["worker"])

    text = await _metrics(process, http)
    route, ok = "/v1/chat/completions", "2xx"
    assert metric_in_text(text, "tether_requests_total", route=route, status_class=ok) == requests
    assert metric_in_text(text, "tether_requests_in_flight") == 0
    assert metric_in_text(text, "tether_upstream_ready") == 1
    assert metric_in_text(text, "tether_workers") == 2
    assert metric_in_text(text, "tether_worker_restarts_total") == 0
    exposed = {(family.name, family.type) for family in text_string_to_metric_families(text)}
    one_tether = {(family.name, family.type) for family in Metrics().registry.collect()}
    assert one_tether <= exposed


async def test_abort_by_client_id_reaches_whichever_worker_holds_it(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
    collected_log: CollectedLog,
) -> None:
    """`POST /admin/abort` on the supervisor stops a stream on one worker, `tether abort`
    one on the other: the engine receives the abort for each one's internal ID, and the
    answer has one tether's shape."""
    engine, engine_url = await fake_engine(token_interval=0.02)
    process = await tether_process(engine_url, **TWO_WORKERS)
    streams = await _streams_on_both_workers(process, http, "held", max_tokens=100_000)
    on_0 = next(stream for stream in streams if stream.worker == 0)
    on_1 = next(stream for stream in streams if stream.worker == 1)

    body = {"request_id": on_0.client_request_id}
    async with http.post(process.admin_url("/admin/abort"), json=body, headers=ADMIN) as response:
        assert response.status == 200
        answer = await response.json()
    assert answer["aborted"] == [on_0.internal_request_id]
    assert set(answer) == {"request_id", "scope", "replica", "instance", "aborted"}
    await engine.wait_for(lambda: on_0.internal_request_id in engine.aborted_ids())

    done = await asyncio.to_thread(
        run_tether_cli,
        collected_log,
        *("abort", on_1.client_request_id, "--admin-url", process.admin_url("")),
        env={"TETHER_ADMIN_TOKEN": TOKEN},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"aborted {on_1.client_request_id!r} on ")
    await engine.wait_for(lambda: on_1.internal_request_id in engine.aborted_ids())
    assert engine.aborted_ids() == {on_0.internal_request_id, on_1.internal_request_id}


async def test_a_fleet_abort_asks_the_other_replicas_once_and_skips_itself(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """`"scope": "fleet"` on the supervisor: its workers abort locally, and each peer is
    asked once; the peer list naming the supervisor itself (as a DNS answer does) is
    recognised by its instance ID and left out."""
    engine, engine_url = await fake_engine(token_interval=0.02)
    other = await tether_process(engine_url, TETHER_ADMIN_TOKEN=TOKEN)
    admin_port = free_port()
    peers = f"127.0.0.1:{admin_port},127.0.0.1:{other.admin_port}"
    process = await tether_process(
        engine_url, TETHER_ADMIN_PORT=str(admin_port), TETHER_FLEET_PEERS=peers, **TWO_WORKERS
    )
    client = await RawClient.connect(other.port)
    await client.send_request(chat_body(max_tokens=100_000), headers={"X-Request-Id": "away"})
    await client.read_until(b"tok0")

    body = {"request_id": "away", "scope": "fleet"}
    async with http.post(process.admin_url("/admin/abort"), json=body, headers=ADMIN) as response:
        assert response.status == 200
        answer = await response.json()
    assert answer["aborted"] == [] and answer["aborted_total"] == 1
    [peer] = answer["peers"]
    assert peer["peer"] == f"127.0.0.1:{other.admin_port}" and peer["status"] == "ok"
    [internal_id] = engine.generations
    assert peer["aborted"] == [internal_id]
    await engine.wait_for(lambda: engine.aborted_ids() == {internal_id})
    await client.read_until_cut()


async def test_admin_calls_need_the_token_on_the_supervisor_too(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """The in-flight list and abort answer 401 without the token, as one tether does."""
    _, engine_url = await fake_engine()
    process = await tether_process(engine_url, **TWO_WORKERS)
    async with http.get(process.admin_url("/admin/requests")) as response:
        assert response.status == 401
        assert (await response.json())["error"]["code"] == "invalid_admin_token"
    body = {"request_id": "x"}
    async with http.post(process.admin_url("/admin/abort"), json=body) as response:
        assert response.status == 401


async def test_a_token_that_is_not_utf8_gets_401_on_the_supervisor_too(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """An `Authorization` header that is not UTF-8 (the right token with a Latin-1 byte
    after it) is a wrong token on the supervisor's admin port as well: 401 with the JSON
    error, never a 500."""
    _, engine_url = await fake_engine()
    process = await tether_process(engine_url, **TWO_WORKERS)
    for method, path, body in (
        ("GET", "/admin/requests", b""),
        ("POST", "/admin/abort", b'{"request_id": "x"}'),
    ):
        client = await RawClient.connect(process.admin_port)
        authorization = f"Bearer {TOKEN}".encode() + b"\xe9"
        await client.send(
            request_with_header_bytes(path, "Authorization", authorization, method, body)
        )

        reply = await client.read_reply()

        assert reply.status == 401, path
        assert reply.json()["error"]["code"] == "invalid_admin_token"
        client.close_fin()


async def test_readiness_names_each_worker_that_is_not_ready(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """With the engine failing its health check, /readyz is 503 naming both workers and
    their reason; ready again once it passes."""
    engine, engine_url = await fake_engine()
    process = await tether_process(engine_url, **TWO_WORKERS)
    engine.healthy = False

    async def not_ready() -> str | None:
        status, body = await _readiness(process, http)
        return body["reason"] if status == 503 and body["reason"].count("503") == 2 else None

    reason = await poll_until(not_ready, 5, interval=0.02, what="both workers not ready")
    assert reason.startswith("worker 0: ") and "; worker 1: " in reason
    engine.healthy = True
    await poll_until(
        lambda: _status_is(process, http, 200), 5, interval=0.02, what="/readyz to be 200"
    )


async def _status_is(process: TetherProcess, http: aiohttp.ClientSession, status: int) -> bool:
    return (await _readiness(process, http))[0] == status


async def test_a_killed_worker_is_restarted_while_the_other_serves(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """SIGKILL to a worker: `worker_exited` (error, the signal), readiness names it while it
    is missing, the other worker serves meanwhile; then `worker_restarted`, ready again, and
    `tether_worker_restarts_total` is 1."""
    _, engine_url = await fake_engine(max_tokens=2)
    process = await tether_process(engine_url, **TWO_WORKERS)
    victim = await process.wait_event("worker_started", worker=1)
    os.kill(victim["pid"], signal.SIGKILL)

    exited = await process.wait_event("worker_exited", index=1)
    assert exited["level"] == "error" and exited["signal"] == "SIGKILL"
    assert exited["pid"] == victim["pid"]
    # Missing for the restart delay (0.5 s) and its start-up, at least.
    status, body = await _readiness(process, http)
    assert (status, body["reason"]) == (503, "worker 1 not running")
    async with http.post(process.url(), json=chat_body(stream=False)) as response:
        assert response.status == 200

    restarted_line = await process.wait_event("worker_restarted", index=1)
    assert restarted_line["pid"] != victim["pid"]
    await poll_until(
        lambda: _status_is(process, http, 200), 5, interval=0.02, what="/readyz to be 200"
    )
    text = await _metrics(process, http)
    assert metric_in_text(text, "tether_worker_restarts_total") == 1
    assert metric_in_text(text, "tether_workers") == 2


async def test_sigterm_drains_every_worker_then_aborts_what_is_left(
    fake_engine: FakeEngineFactory,
    tether_process: TetherProcessFactory,
    http: aiohttp.ClientSession,
) -> None:
    """SIGTERM: readiness 503 at once, new connections refused, the short streams on both
    workers finish, the long ones on both are aborted upstream after the grace, exit 0."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    process = await tether_process(engine_url, TETHER_SHUTDOWN_GRACE="3", **TWO_WORKERS)
    long = await _streams_on_both_workers(process, http, "long", max_tokens=100_000)
    # The short streams need 2 s (200 tokens, 10 ms apart), less than the grace period, and
    # still run when the shutdown starts.
    short = await _streams_on_both_workers(process, http, "short", max_tokens=200)

    process.send_signal(signal.SIGTERM)
    await poll_until(
        lambda: _status_is(process, http, 503), 2, interval=0.02, what="/readyz to turn 503"
    )
    assert (await _readiness(process, http))[1]["reason"] == "tether is shutting down"
    await poll_until(lambda: _refused(process), 5, interval=0.02, what="new connections refused")

    for stream in short:
        assert (await stream.client.read_until(b"data: [DONE]")).endswith(b"data: [DONE]")
    for stream in long:
        await stream.client.read_until_cut()
    assert await process.wait_exit(timeout=20) == 0
    states = {s.internal_request_id: engine.generation(s.internal_request_id).state for s in short}
    assert set(states.values()) == {GenerationState.COMPLETED}
    long_ids = {stream.internal_request_id for stream in long}
    assert engine.aborted_ids() == long_ids
    assert process.events("shutdown_finished")[-1].get("worker") is None  # the supervisor's


async def _refused(process: TetherProcess) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", process.port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def test_workers_auto_starts_one_per_usable_cpu(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """TETHER_WORKERS=auto: as many workers as CPUs this process may use, on TETHER_PORT=0
    resolved once by the supervisor for all of them."""
    _, engine_url = await fake_engine()
    process = await tether_process(engine_url, TETHER_WORKERS="auto", TETHER_PORT="0")
    started = await process.wait_event("tether_started")
    assert started.get("workers", 1) == usable_cpus()
    assert process.port != 0
    assert {entry["port"] for entry in process.events("worker_started")} <= {process.port}


@pytest.mark.parametrize("workers", ["2", "auto"])
def test_preserve_mode_with_several_workers_stops_start_up_naming_both(
    workers: str, collected_log: CollectedLog
) -> None:
    """Preserve mode's in-flight check sees one process's requests only: a duplicate ID on
    another worker would share the engine's ID, and its client leaving would abort the
    other's request. So TETHER_WORKERS other than 1 is refused with it: exit 2 naming both."""
    env = {
        "TETHER_UPSTREAM_URL": "http://127.0.0.1:9",
        "TETHER_REQUEST_ID_MODE": "preserve",
        "TETHER_WORKERS": workers,
    }
    done = run_tether_cli(collected_log, env=env)
    assert done.returncode == 2
    assert "TETHER_REQUEST_ID_MODE=preserve needs TETHER_WORKERS=1" in done.stderr


@pytest.mark.parametrize("value", ["0", "x", "-1"])
def test_a_bad_workers_value_stops_start_up_naming_it(
    value: str, collected_log: CollectedLog
) -> None:
    """Exit 2 and a message naming TETHER_WORKERS, as for any bad setting."""
    env = {"TETHER_UPSTREAM_URL": "http://127.0.0.1:9", "TETHER_WORKERS": value}
    done = run_tether_cli(collected_log, env=env)
    assert done.returncode == 2
    assert "TETHER_WORKERS: must be a whole number of at least 1, or auto" in done.stderr


def test_a_client_port_in_use_stops_start_up_naming_it(collected_log: CollectedLog) -> None:
    """The supervisor binds the client port before any worker starts: one that another
    process holds stops start-up at once, exit 1, naming TETHER_PORT."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = {
            "TETHER_UPSTREAM_URL": "http://127.0.0.1:9",
            "TETHER_HOST": "127.0.0.1",
            "TETHER_PORT": str(port),
            "TETHER_ADMIN_PORT": "0",
            "TETHER_WORKERS": "2",
        }
        done = run_tether_cli(collected_log, env=env)
    assert done.returncode == 1
    assert done.stderr.startswith(
        f"tether: could not start: TETHER_HOST:TETHER_PORT 127.0.0.1:{port} cannot be used: "
    )
    assert "worker_started" not in done.stdout


def test_a_worker_that_fails_to_start_stops_start_up(
    tmp_path: Path, collected_log: CollectedLog
) -> None:
    """A worker that cannot start (here: its admin socket's path, under a TMPDIR too long
    for a Unix socket, cannot be bound) makes the supervisor exit 1 saying which worker
    failed and how, instead of restarting it in a loop."""
    long_tmp = tmp_path / ("d" * 120)
    long_tmp.mkdir()
    env = {
        "TETHER_UPSTREAM_URL": "http://127.0.0.1:9",
        "TETHER_PORT": "0",
        "TETHER_ADMIN_PORT": "0",
        "TETHER_WORKERS": "2",
        "TMPDIR": str(long_tmp),
    }
    done = run_tether_cli(collected_log, env=env)
    assert done.returncode == 1
    assert "tether: could not start: worker 0 exited while starting (exit_code 1)" in done.stderr
    assert "AF_UNIX path too long" in done.stdout + done.stderr
    assert "worker_restarted" not in done.stdout


@pytest.mark.socket_free
@pytest.mark.parametrize(
    ("cpu_max", "cpus"), [("max 100000\n", None), ("150000 100000\n", 2), ("50000 100000", 1)]
)
def test_the_cgroup_quota_counts_in_whole_cpus(
    tmp_path: Path, cpu_max: str, cpus: int | None
) -> None:
    """cgroup v2's `cpu.max`: no quota, 1.5 CPUs (2 kept busy), half a CPU (still 1)."""
    path = tmp_path / "cpu.max"
    path.write_text(cpu_max)
    assert cgroup_quota_cpus(path) == cpus
    assert cgroup_quota_cpus(tmp_path / "absent") is None


async def test_a_killed_supervisor_leaves_no_worker_running(
    fake_engine: FakeEngineFactory, tether_process: TetherProcessFactory
) -> None:
    """SIGKILL to the supervisor: each worker reads its lifeline's end and shuts down."""
    _, engine_url = await fake_engine()
    process = await tether_process(engine_url, **TWO_WORKERS)
    pids = [entry["pid"] for entry in process.events("worker_started")]
    assert len(pids) == 2
    process.send_signal(signal.SIGKILL)
    # The output ends only when the workers, which share it, have exited too.
    assert await process.wait_exit(timeout=15) == -signal.SIGKILL
    await poll_until(lambda: not any(_alive(pid) for pid in pids), 5, what="the workers to exit")
    assert len([e for e in process.events("shutdown_finished") if "worker" in e]) == 2


@pytest.fixture
def short_tmpdir() -> Iterator[Path]:
    """A temporary directory for tethers' TMPDIR, short enough for the workers' socket paths
    (108 bytes at most) where pytest's own would not be."""
    with tempfile.TemporaryDirectory(prefix="tether-test-") as path:
        yield Path(path)


def _runtime_directories(parent: Path) -> set[Path]:
    return set(parent.glob(f"{supervisor_runtime.PREFIX}*"))


async def test_a_killed_supervisors_directory_is_removed_by_the_next_one(
    fake_engine: FakeEngineFactory, short_tmpdir: Path, tether_process: TetherProcessFactory
) -> None:
    """SIGKILL leaves the supervisor's runtime directory behind; the next supervisor to start
    removes it, and leaves the one of a supervisor that still runs."""
    _, engine_url = await fake_engine()
    env = {**TWO_WORKERS, "TMPDIR": str(short_tmpdir)}
    await tether_process(engine_url, **env)
    [live] = _runtime_directories(short_tmpdir)
    killed = await tether_process(engine_url, **env)
    [left_behind] = _runtime_directories(short_tmpdir) - {live}
    killed.send_signal(signal.SIGKILL)
    assert await killed.wait_exit(timeout=15) == -signal.SIGKILL
    assert left_behind.exists()

    await tether_process(engine_url, **env)

    assert live in _runtime_directories(short_tmpdir)
    assert left_behind not in _runtime_directories(short_tmpdir)
    assert len(_runtime_directories(short_tmpdir)) == 2


def _make_runtime_directory(parent: Path, name: str, *, lock: bool = True) -> Path:
    path = parent / f"{supervisor_runtime.PREFIX}{name}"
    path.mkdir(mode=0o700)
    (path / "worker-0.sock").touch()
    if lock:
        (path / supervisor_runtime.LOCK_NAME).touch()
    return path


@pytest.mark.socket_free
def test_only_this_users_unlocked_directories_are_removed(short_tmpdir: Path) -> None:
    """A sweep removes a directory whose lock nobody holds, and leaves one whose lock is held
    (a live supervisor), one without a lock (being made, or an older tether's), another
    user's and anything not named like a runtime directory."""
    stale = _make_runtime_directory(short_tmpdir, "stale")
    live = _make_runtime_directory(short_tmpdir, "live")
    unlocked_yet = _make_runtime_directory(short_tmpdir, "new", lock=False)
    unrelated = short_tmpdir / "something-else"
    unrelated.mkdir()
    others = None
    if os.getuid() == 0:  # only root can give a directory to another user
        others = _make_runtime_directory(short_tmpdir, "others")
        os.chown(others, 4242, 4242)
        os.chown(others / supervisor_runtime.LOCK_NAME, 4242, 4242)
    held = os.open(live / supervisor_runtime.LOCK_NAME, os.O_RDONLY)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)
        supervisor_runtime.remove_stale(str(short_tmpdir))
    finally:
        os.close(held)

    assert not stale.exists()
    assert live.exists() and unlocked_yet.exists() and unrelated.exists()
    assert others is None or others.exists()


def test_workers_answer_each_other_only_from_a_directory_private_to_this_user(
    tmp_path: Path,
) -> None:
    """The runtime directory authorises the workers' token-less calls to each other: one that
    other users can reach is refused (the worker does not start), naming its mode."""
    private = tmp_path / "private"
    private.mkdir()
    private.chmod(0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    with supervisor_runtime.runtime_directory() as made:
        assert private_directory_problem(made) is None  # what the supervisor makes

    assert private_directory_problem(str(private)) is None
    assert private_directory_problem(str(shared)) == (
        f"{shared} is reachable by other users (mode 755)"
    )
