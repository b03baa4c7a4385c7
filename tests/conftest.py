"""Self-cleaning factories: settings that never read the environment, a fake engine that
records what it saw, tether run by the production runner (in-process, or as the real process),
and the request helpers every test file uses. The tools themselves live in `tests.support`.

Every log line tether writes during the run, here or in a process a test starts, is also
collected into one file (`tests.support.collected_log`) for the canary grep."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Protocol, TextIO, cast

import aiohttp
import pytest
import structlog
from aiohttp import web
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from proxy.logging import configure_logging
from proxy.runner import TetherServer
from proxy.settings import LogFormat, LogLevel, Settings
from tether_fake_engine import FakeEngine

from .support.canaries import CANARY_PROMPT
from .support.collected_log import IN_PROCESS, UPSTREAM, CollectedLog, log_file
from .support.metrics import metric
from .support.processes import (
    EngineProcess,
    TetherProcess,
    start_engine_process,
    start_tether_process,
)
from .support.raw_http import RawClient
from .support.waiting import within

# How long a test waits for tether to let go of its requests or finish its abort calls.
SETTLE_TIMEOUT = 5.0
UPSTREAM_LOGGER = "tests.upstream"

_COLLECTED_LOG = pytest.StashKey[CollectedLog]()


# --- the collected log ------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    log = CollectedLog(log_file())
    config.stash[_COLLECTED_LOG] = log
    # In-process tether logs as production does (its processors, JSON), at debug level so every
    # line it could ever write is produced, into pytest's captured stdout and the collected log.
    configure_logging(LogFormat.JSON, LogLevel.DEBUG)
    stream = cast(TextIO, log.stream(IN_PROCESS))
    # Loggers are not cached: structlog.testing.capture_logs() must keep working in tests.
    structlog.configure(
        logger_factory=structlog.WriteLoggerFactory(stream), cache_logger_on_first_use=False
    )
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(stream)
    # The test's own upstreams (the fake engine) are not tether: their lines are kept apart.
    upstream = logging.getLogger(UPSTREAM_LOGGER)
    upstream.propagate = False
    upstream_handler = logging.StreamHandler(cast(TextIO, log.stream(UPSTREAM)))
    upstream_handler.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))
    upstream.addHandler(upstream_handler)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """A line naming the test before anything it logs (its fixtures included)."""
    item.config.stash[_COLLECTED_LOG].mark_test(item.nodeid)


def pytest_unconfigure(config: pytest.Config) -> None:
    log = config.stash.get(_COLLECTED_LOG, None)
    if log is not None:
        log.close()


@pytest.fixture(scope="session")
def collected_log(pytestconfig: pytest.Config) -> CollectedLog:
    """The run's collected log, for output a test gets hold of itself (subprocesses)."""
    return pytestconfig.stash[_COLLECTED_LOG]


# --- settings -----------------------------------------------------------------------------------


class IsolatedSettings(Settings):
    """Settings built from arguments only: the test machine's environment and .env are ignored."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def make_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "upstream_url": "http://127.0.0.1:9",
        "host": "127.0.0.1",
        "port": 0,
        "admin_host": "127.0.0.1",
        "admin_port": 0,
        "shutdown_grace": 0,
        "health_interval": 0.05,
        "abort_repeat_delay": 0,
    }
    values.update(overrides)
    return IsolatedSettings(**values)


class SettingsFactory(Protocol):
    def __call__(self, **overrides: Any) -> Settings: ...


@pytest.fixture
def settings() -> SettingsFactory:
    return make_settings


# --- upstreams ----------------------------------------------------------------------------------


class UpstreamServer:
    """An upstream app served on loopback, as real engines' ASGI servers run: handlers are
    cancelled on disconnect (the fake engine decides by itself whether that stops its
    generation), and the accept queue is deep enough for thousands of concurrent streams.

    It logs through its own logger (`UPSTREAM_LOGGER`), so its errors, which show request
    bodies, are not taken for tether's in the collected log."""

    def __init__(self, app: web.Application, port: int = 0) -> None:
        self._runner = web.AppRunner(
            app,
            handler_cancellation=True,
            access_log=None,
            logger=logging.getLogger(UPSTREAM_LOGGER),
        )
        self._port = port
        self.url = ""

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self._port, backlog=4096)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        await self._runner.cleanup()


async def serve_upstream(app: web.Application, port: int = 0) -> UpstreamServer:
    server = UpstreamServer(app, port)
    await server.start()
    return server


class FakeEngineFactory(Protocol):
    def __call__(self, **options: Any) -> Awaitable[tuple[FakeEngine, str]]: ...


class UpstreamAppFactory(Protocol):
    def __call__(self, app: web.Application) -> Awaitable[str]: ...


@pytest.fixture
async def fake_engine() -> AsyncIterator[FakeEngineFactory]:
    """Start a FakeEngine(**options) on loopback; returns it and its base URL."""
    servers: list[UpstreamServer] = []

    async def start(**options: Any) -> tuple[FakeEngine, str]:
        engine = FakeEngine(**options)
        server = await serve_upstream(engine.app)
        servers.append(server)
        return engine, server.url

    yield start
    for server in servers:
        await server.close()


@pytest.fixture
async def upstream_app() -> AsyncIterator[UpstreamAppFactory]:
    """Serve a test's own upstream app (for wire-level behaviours); returns its base URL."""
    servers: list[UpstreamServer] = []

    async def start(app: web.Application) -> str:
        server = await serve_upstream(app)
        servers.append(server)
        return server.url

    yield start
    for server in servers:
        await server.close()


# --- tether -------------------------------------------------------------------------------------


class TetherFactory(Protocol):
    def __call__(self, upstream_url: str, **overrides: Any) -> Awaitable[TetherServer]: ...


@pytest.fixture
async def tether() -> AsyncIterator[TetherFactory]:
    """tether on loopback, through the same runner `__main__` uses."""
    servers: list[TetherServer] = []

    async def start(upstream_url: str, **overrides: Any) -> TetherServer:
        server = TetherServer(make_settings(upstream_url=upstream_url, **overrides))
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


class TetherProcessFactory(Protocol):
    def __call__(self, engine_url: str, **env: str) -> Awaitable[TetherProcess]: ...


@pytest.fixture
async def tether_process(collected_log: CollectedLog) -> AsyncIterator[TetherProcessFactory]:
    """The real `tether` process in front of `engine_url`, TETHER_* settings from `env`; its
    output is `process.output()` (and in the collected log). Killed at teardown if still up."""
    started: list[TetherProcess] = []

    async def start(engine_url: str, **env: str) -> TetherProcess:
        process = await start_tether_process(engine_url, collected_log, env)
        started.append(process)
        return process

    yield start
    for process in started:
        await process.close()


class EngineProcessFactory(Protocol):
    def __call__(self, *args: str) -> Awaitable[EngineProcess]: ...


@pytest.fixture
async def engine_process() -> AsyncIterator[EngineProcessFactory]:
    """The fake engine as its own process (a test may kill it); `args` are its CLI options."""
    started: list[EngineProcess] = []

    async def start(*args: str) -> EngineProcess:
        engine = await start_engine_process(*args)
        started.append(engine)
        return engine

    yield start
    for engine in started:
        await engine.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session whose every request is bounded (a hang fails, it does not block)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


# --- requests and what tether made of them ------------------------------------------------------


def url(server: TetherServer, path: str = "/v1/chat/completions") -> str:
    return f"http://127.0.0.1:{server.port}{path}"


def admin_url(server: TetherServer, path: str) -> str:
    return f"http://127.0.0.1:{server.admin_port}{path}"


def chat_body(stream: bool = True, max_tokens: int = 5, **fake: Any) -> dict[str, Any]:
    """A chat completion request whose prompt is the canary (it must never be logged)."""
    body: dict[str, Any] = {
        "model": "fake",
        "messages": [{"role": "user", "content": CANARY_PROMPT}],
        "stream": stream,
        "max_tokens": max_tokens,
    }
    if fake:
        body["fake"] = fake
    return body


def sse_ids(text: str) -> list[str]:
    """The `id` of every JSON event in an SSE body."""
    return [
        json.loads(line[len("data: ") :])["id"]
        for line in text.splitlines()
        if line.startswith("data: {")
    ]


async def settled(server: TetherServer, timeout: float = SETTLE_TIMEOUT) -> None:
    """No request left in flight: the registry is empty and the in-flight gauge agrees."""
    await within(server.context.registry.wait_empty(), timeout, "tether's registry to empty")
    assert metric(server.context.metrics.registry, "tether_requests_in_flight") == 0


async def drained(server: TetherServer, timeout: float = SETTLE_TIMEOUT) -> None:
    """Every abort call tether started has ended (each is bounded by the abort deadline)."""
    await within(server.context.aborts.drain(), timeout, "tether's abort calls to end")


async def leave_mid_stream(
    server: TetherServer,
    *,
    close: str = "fin",
    body: dict[str, Any] | None = None,
    path: str = "/v1/chat/completions",
    headers: dict[str, str] | None = None,
) -> None:
    """Open a long stream through tether, read its first token, leave (FIN or RST), and return
    once tether has let go of the request (its abort is then handed over)."""
    client = await RawClient.connect(server.port)
    await client.send_request(body or chat_body(max_tokens=100_000), path=path, headers=headers)
    await client.read_until(b"tok0")
    client.close(close)
    await within(server.context.registry.wait_empty(), SETTLE_TIMEOUT, "tether to let go")
