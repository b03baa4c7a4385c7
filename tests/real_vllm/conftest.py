"""Fixtures for the real-vLLM suite: one vLLM (CPU) + tether stack per configuration.

The suite is opt-in (`TETHER_VLLM_TESTS=1`): starting vLLM costs 20-45 s, so the normal unit
test run skips it. Tests name the configuration they need through the `stack` fixture's
parameter; collection is ordered by configuration so each vLLM starts exactly once.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator

import pytest

from .collection import prepare_suite
from .measurements import Measurements
from .processes import (
    CONFIGS,
    EngineInstall,
    Stack,
    StackPool,
    install_engine,
    start_stack,
    suite_log_dir,
)

ENABLED = os.environ.get("TETHER_VLLM_TESTS") == "1"
SKIP_REASON = "real vLLM suite is opt-in: set TETHER_VLLM_TESTS=1 (see tests/real_vllm/README.md)"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs against a real vLLM (CPU build); needs TETHER_VLLM_TESTS=1"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    prepare_suite(
        config,
        items,
        suite_dir=pathlib.Path(__file__).parent,
        marker=pytest.mark.vllm,
        configurations=CONFIGS,
        skip_reason=None if ENABLED else SKIP_REASON,
    )


@pytest.fixture(scope="session")
def measurements(request: pytest.FixtureRequest) -> Measurements:
    found = Measurements()
    request.config.stash[Measurements.KEY] = found
    return found


@pytest.fixture(scope="session")
def engine_install() -> EngineInstall:
    return install_engine()


@pytest.fixture(scope="session")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return suite_log_dir("TETHER_VLLM_LOG_DIR", tmp_path_factory, "real_vllm_logs")


@pytest.fixture(scope="session")
def stack_pool(
    engine_install: EngineInstall, log_dir: pathlib.Path, measurements: Measurements
) -> Iterator[StackPool[Stack]]:
    pool = StackPool(lambda name: start_stack(name, engine_install, log_dir))
    yield pool
    pool.close()
    pool.report(measurements, "vLLM")


@pytest.fixture
def stack(request: pytest.FixtureRequest, stack_pool: StackPool[Stack]) -> Stack:
    """The running vLLM + tether of the configuration named by the test's parameter."""
    return stack_pool.get(request.param)


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    found = config.stash.get(Measurements.KEY, None)
    if found is not None and found.rows:
        terminalreporter.section("real vLLM measurements")
        for line in found.lines():
            terminalreporter.write_line(line)
