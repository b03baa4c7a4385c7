"""Fixtures for the real-SGLang suite: one SGLang (CPU) + tether stack per configuration.

The suite is opt-in (`TETHER_SGLANG_TESTS=1`): starting SGLang costs 30-60 s, so the normal
unit test run skips it. Tests name the configuration they need through the `stack` fixture's
parameter; collection is ordered by configuration so each SGLang starts exactly once.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterator

import pytest

from ..real_vllm.collection import prepare_suite
from ..real_vllm.measurements import Measurements
from ..real_vllm.processes import StackPool, Tether, suite_log_dir
from .measurements import IDLE_TOPIC, idle_table
from .processes import CONFIGS, SglangInstall, Stack, install_engine, start_stack, start_tether

ENABLED = os.environ.get("TETHER_SGLANG_TESTS") == "1"
SKIP_REASON = (
    "real SGLang suite is opt-in: set TETHER_SGLANG_TESTS=1 (see tests/real_sglang/README.md)"
)
MEASUREMENTS = pytest.StashKey[Measurements]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "sglang: runs against a real SGLang (CPU); needs TETHER_SGLANG_TESTS=1"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    prepare_suite(
        config,
        items,
        suite_dir=pathlib.Path(__file__).parent,
        marker=pytest.mark.sglang,
        configurations=CONFIGS,
        skip_reason=None if ENABLED else SKIP_REASON,
    )


@pytest.fixture(scope="session")
def measurements(request: pytest.FixtureRequest) -> Measurements:
    found = Measurements("TETHER_SGLANG_MEASUREMENTS")
    request.config.stash[MEASUREMENTS] = found
    return found


@pytest.fixture(scope="session")
def engine_install() -> SglangInstall:
    return install_engine()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return suite_log_dir("TETHER_SGLANG_LOG_DIR", tmp_path_factory, "real_sglang_logs")


@pytest.fixture(scope="session")
def stack_pool(
    engine_install: SglangInstall, log_dir: pathlib.Path, measurements: Measurements
) -> Iterator[StackPool[Stack]]:
    pool = StackPool(lambda name: start_stack(name, engine_install, log_dir))
    yield pool
    pool.close()
    pool.report(measurements, "SGLang")


@pytest.fixture
def stack(request: pytest.FixtureRequest, stack_pool: StackPool[Stack]) -> Stack:
    """The running SGLang + tether of the configuration named by the test's parameter."""
    return stack_pool.get(request.param)


@pytest.fixture
def own_tether(
    stack: Stack, log_dir: pathlib.Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[dict[str, str]], Tether]]:
    """Start another tether in front of the stack's SGLang, with these TETHER_* settings;
    stopped when the test ends."""
    started: list[Tether] = []

    def start(settings: dict[str, str]) -> Tether:
        name = f"tether-{request.node.name}-{len(started)}".replace("/", "_")
        started.append(start_tether(stack.sglang, log_dir / f"{name}.log", settings))
        return started[-1]

    yield start
    for tether in started:
        tether.process.stop()


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    found = config.stash.get(MEASUREMENTS, None)
    if found is not None and found.rows:
        terminalreporter.section("real SGLang measurements")
        # The per-phase idle times are in the table; the other measurements one per line.
        others = [line for line in found.lines() if not line.startswith(IDLE_TOPIC)]
        for line in [*idle_table(found), "", *others]:
            terminalreporter.write_line(line)
