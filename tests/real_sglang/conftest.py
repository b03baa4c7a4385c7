"""Fixtures for the real-SGLang suite: one SGLang (CPU) + tether stack per configuration.

The suite is opt-in (`TETHER_SGLANG_TESTS=1`): starting SGLang costs 30-60 s, so the normal
unit test run skips it. Tests name the configuration they need through the `stack` fixture's
parameter; collection is ordered by configuration so each SGLang starts exactly once. The
fixtures are the ones both real-engine suites share (`tests.support.real_engine.fixtures`),
driven by this suite's `suite`, and `own_tether`.
"""

from __future__ import annotations

import pathlib
from collections.abc import Callable, Iterator

import pytest

from ..support.real_engine.fixtures import engine_install as engine_install
from ..support.real_engine.fixtures import log_dir as log_dir
from ..support.real_engine.fixtures import measurements as measurements
from ..support.real_engine.fixtures import router as router
from ..support.real_engine.fixtures import stack as stack
from ..support.real_engine.fixtures import stack_pool as stack_pool
from ..support.real_engine.measurements import Measurements
from ..support.real_engine.suite import Suite
from ..support.real_engine.tether import Tether
from .measurements import IDLE_TOPIC, idle_table
from .processes import CONFIGS, Stack, install_engine, start_stack, start_tether


def _summary(found: Measurements) -> list[str]:
    """The per-phase idle times in the table; the other measurements one per line."""
    others = [line for line in found.lines() if not line.startswith(IDLE_TOPIC)]
    return [*idle_table(found), "", *others]


SUITE = Suite(
    engine="SGLang",
    variable="SGLANG",
    marker="sglang",
    description="a real SGLang (CPU)",
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
