"""Fixtures for the real llama.cpp suite: one llama-server + tether stack per configuration.

The suite is opt-in (`TETHER_LLAMACPP_TESTS=1`): building llama-server takes minutes the
first time, so the normal unit test run skips it. Tests name the configuration they need
through the `stack` fixture's parameter; collection is ordered by configuration so each
llama-server starts exactly once. The fixtures are the ones all real-engine suites share
(`tests.support.real_engine.fixtures`), driven by this suite's `suite`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import pytest

from ..support.real_engine.fixtures import engine_install as engine_install
from ..support.real_engine.fixtures import log_dir as log_dir
from ..support.real_engine.fixtures import measurements as measurements
from ..support.real_engine.fixtures import stack as stack
from ..support.real_engine.fixtures import stack_pool as stack_pool
from ..support.real_engine.measurements import Measurements
from ..support.real_engine.suite import Suite
from .measurements import NOBODY_TOPIC, STOP_TOPIC, stop_table
from .processes import CONFIGS, Stack, install_engine, start_stack

# Seconds a test's requests may take to be let go once it ended (a non-streaming one is
# noticed at llama-server's next one-second look).
SETTLE = 15.0


def _summary(found: Measurements) -> list[str]:
    """The per-phase stop times in the table; the other measurements one per line."""
    others = [line for line in found.lines() if not line.startswith((STOP_TOPIC, NOBODY_TOPIC))]
    return [*stop_table(found), "", *others]


SUITE = Suite(
    engine="llama.cpp",
    variable="LLAMACPP",
    marker="llamacpp",
    description="a real llama.cpp server (llama-server)",
    directory=pathlib.Path(__file__).parent,
    configurations=CONFIGS,
    install=install_engine,
    start_stack=start_stack,
    summary=_summary,
)


# The suite's hooks.
pytest_configure = SUITE.configure
pytest_collection_modifyitems = SUITE.prepare
pytest_terminal_summary = SUITE.report


@pytest.fixture(scope="session")
def suite() -> Suite:
    """This suite, for the shared fixtures."""
    return SUITE


@pytest.fixture(autouse=True)
def nothing_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test, every request it had llama-server start has been let go: the next test
    measures on idle slots."""
    if "stack" not in request.fixturenames:
        yield
        return
    stack: Stack = request.getfixturevalue("stack")
    mark = stack.llamacpp.events.mark()
    yield
    stack.llamacpp.events.wait_all_released(mark, SETTLE)
