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

from .measurements import Measurements
from .processes import CONFIGS, EngineInstall, Stack, StackPool, install_engine

ENABLED = os.environ.get("TETHER_VLLM_TESTS") == "1"
SKIP_REASON = "real vLLM suite is opt-in: set TETHER_VLLM_TESTS=1 (see tests/real_vllm/README.md)"
# Seconds one test may take, vLLM's start (up to a minute on a loaded machine) included; the
# repository's default pytest-timeout is sized for unit tests.
TEST_TIMEOUT = 600


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: runs against a real vLLM (CPU build); needs TETHER_VLLM_TESTS=1"
    )


def _config_of(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "stack" in callspec.params:
        return str(callspec.params["stack"])
    return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = pathlib.Path(__file__).parent
    ours = [item for item in items if here in pathlib.Path(str(item.path)).parents]
    if not ours:
        return
    order = list(CONFIGS)
    for item in ours:
        item.add_marker(pytest.mark.vllm)
        if config.pluginmanager.hasplugin("timeout"):
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))
        if not ENABLED:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
    # Stable sort of our items by configuration, keeping them where they were in the list.
    positions = [index for index, item in enumerate(items) if item in ours]
    ranked = sorted(
        ours, key=lambda item: order.index(_config_of(item)) if _config_of(item) in order else -1
    )
    for index, item in zip(positions, ranked, strict=True):
        items[index] = item


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
    configured = os.environ.get("TETHER_VLLM_LOG_DIR")
    if configured:
        path = pathlib.Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("real_vllm_logs")


@pytest.fixture(scope="session")
def stack_pool(
    engine_install: EngineInstall, log_dir: pathlib.Path, measurements: Measurements
) -> Iterator[StackPool]:
    pool = StackPool(engine_install, log_dir)
    yield pool
    pool.close()
    for name, vllm_ready, total in pool.started:
        measurements.add("startup", f"vLLM {name} ready (s)", vllm_ready)
        measurements.add("startup", f"vLLM {name} + tether ready (s)", total)
    for name, count in pool.tether_error_lines.items():
        measurements.add("tether log", f"{name}: error-level lines in tether's log", count)


@pytest.fixture
def stack(request: pytest.FixtureRequest, stack_pool: StackPool) -> Stack:
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
