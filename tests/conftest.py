"""Fixtures: self-cleaning factories (settings that never read the environment, a fake engine
that records what it saw, tether run by the production runner in-process or as the real
process), the hooks that collect every log line, and `--stage` (the stages CI runs the tests
in: `tests.support.stages`). What the fixtures return, and the request helpers every test file
uses, live in `tests.support`.

Every log line tether writes during the run, here or in a process a test starts, is also
collected into one file (`tests.support.collected_log`) for the canary grep."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, TextIO, cast

import aiohttp
import pytest
import structlog
from aiohttp import web

from proxy import compiled
from proxy.faults import Faults
from proxy.observe.logging import configure_logging
from proxy.server.runner import TetherServer
from proxy.settings import LogFormat, LogLevel
from tether_fake_engine import FakeEngine

from .support.collected_log import IN_PROCESS, UPSTREAM, CollectedLog, log_file
from .support.in_process import TetherFactory
from .support.processes import (
    EngineProcess,
    EngineProcessFactory,
    TetherProcess,
    TetherProcessFactory,
    start_engine_process,
    start_tether_process,
)
from .support.settings import SettingsFactory, make_settings
from .support.stages import STAGES, StagePlugin
from .support.upstreams import (
    UPSTREAM_LOGGER,
    FakeEngineFactory,
    UpstreamAppFactory,
    UpstreamServer,
    serve_upstream,
)

_COLLECTED_LOG = pytest.StashKey[CollectedLog]()


# --- the stages CI runs the tests in -----------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--stage",
        choices=STAGES,
        help="run only this stage's tests (tests/support/stages.py); the soak needs -m soak too",
    )


# --- the collected log ------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(StagePlugin(config.getoption("stage")), "tether-stages")
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


def pytest_report_header() -> str:
    """Which code the run tests: the compiled data plane or the pure-Python one."""
    return f"tether data plane: {compiled.extensions()}"


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


@pytest.fixture
def settings() -> SettingsFactory:
    return make_settings


# --- upstreams ----------------------------------------------------------------------------------


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


@pytest.fixture
async def tether() -> AsyncIterator[TetherFactory]:
    """tether on loopback, through the same runner `__main__` uses."""
    servers: list[TetherServer] = []

    async def start(
        upstream_url: str, *, faults: Faults | None = None, **overrides: Any
    ) -> TetherServer:
        server = TetherServer(make_settings(upstream_url=upstream_url, **overrides), faults=faults)
        await server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        await server.stop()


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
