"""The fixtures both real-engine suites use, driven by the `suite` fixture each suite's
conftest defines (a `tests.support.real_engine.suite.Suite`). A conftest imports them by name
(`from ..support.real_engine.fixtures import stack as stack`): each suite then has its own
session-wide stack pool, log directory and measurements."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator
from typing import Any

import pytest

from ..smg import Smg, smg_log, smg_process
from .measurements import Measurements
from .stacks import EngineStack, StackPool
from .suite import Suite


@pytest.fixture(scope="session")
def measurements(suite: Suite, request: pytest.FixtureRequest) -> Measurements:
    """What the suite measured, printed in the terminal summary."""
    return suite.new_measurements(request.config)


@pytest.fixture(scope="session")
def engine_install(suite: Suite) -> Any:
    """The engine's install (its setup script run once, cached across runs)."""
    return suite.install()


@pytest.fixture(scope="session")
def log_dir(suite: Suite, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Where the engine's, tether's and smg's logs go (`TETHER_<ENGINE>_LOG_DIR` if set)."""
    return suite.log_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def stack_pool(
    suite: Suite, engine_install: Any, log_dir: pathlib.Path, measurements: Measurements
) -> Iterator[StackPool[EngineStack[Any]]]:
    pool = StackPool(lambda name: suite.start_stack(name, engine_install, log_dir))
    yield pool
    pool.close()
    pool.report(measurements, suite.engine)


@pytest.fixture
def stack(
    request: pytest.FixtureRequest, stack_pool: StackPool[EngineStack[Any]]
) -> EngineStack[Any]:
    """The running engine + tether of the configuration named by the test's parameter."""
    return stack_pool.get(request.param)


@pytest.fixture
def router(
    stack: EngineStack[Any], log_dir: pathlib.Path, request: pytest.FixtureRequest
) -> Iterator[Smg]:
    """smg in front of the stack's tether; a test starts more with `smg_process`."""
    with smg_process(stack.tether.url, smg_log(log_dir, request, "tether")) as started:
        yield started
