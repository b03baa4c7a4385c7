"""Fixtures for the real-vLLM suite: one vLLM (CPU) + tether stack per configuration.

The suite is opt-in (`TETHER_VLLM_TESTS=1`): starting vLLM costs 20-45 s, so the normal unit
test run skips it. Tests name the configuration they need through the `stack` fixture's
parameter; collection is ordered by configuration so each vLLM starts exactly once. The
fixtures are the ones both real-engine suites share (`tests.support.real_engine.fixtures`),
driven by this suite's `suite`.
"""

from __future__ import annotations

import pathlib

import pytest

from ..support.real_engine.fixtures import engine_install as engine_install
from ..support.real_engine.fixtures import log_dir as log_dir
from ..support.real_engine.fixtures import measurements as measurements
from ..support.real_engine.fixtures import router as router
from ..support.real_engine.fixtures import stack as stack
from ..support.real_engine.fixtures import stack_pool as stack_pool
from ..support.real_engine.suite import Suite
from .processes import CONFIGS, install_engine, start_stack

SUITE = Suite(
    engine="vLLM",
    variable="VLLM",
    marker="vllm",
    description="a real vLLM (CPU build)",
    directory=pathlib.Path(__file__).parent,
    configurations=CONFIGS,
    install=install_engine,
    start_stack=start_stack,
)


# The suite's hooks.
pytest_configure = SUITE.configure
pytest_collection_modifyitems = SUITE.prepare
pytest_terminal_summary = SUITE.report


@pytest.fixture(scope="session")
def suite() -> Suite:
    """This suite, for the shared fixtures."""
    return SUITE
