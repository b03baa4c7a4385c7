"""What a real-engine suite says about itself, and the collection rules both suites follow.

Each suite is opt-in (`TETHER_<ENGINE>_TESTS=1`), gets its marker and a timeout sized for an
engine's start, and has its tests ordered by the engine configuration they need, so that
each configuration starts once. Its conftest describes it with a `Suite`, hands it to the
shared fixtures (`tests.support.real_engine.fixtures`) as the `suite` fixture, and calls its
hooks' counterparts here.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from .measurements import Measurements
from .stacks import EngineStack, suite_log_dir

# Seconds one test may take, the engine's start (up to a minute on a loaded machine)
# included; the repository's default pytest-timeout is sized for unit tests.
TEST_TIMEOUT = 600


@dataclass(frozen=True)
class Suite:
    """One real-engine suite: `tests/<directory>`, run against `engine`."""

    engine: str  # as people write it: "vLLM"; in measurement names and the summary's title
    variable: str  # TETHER_<variable>_TESTS, _LOG_DIR and _MEASUREMENTS are its settings
    marker: str  # the pytest marker of its tests
    description: str  # what the marker says the tests run against
    directory: pathlib.Path
    configurations: Iterable[str]  # in the order they start
    install: Callable[[], Any]  # the engine's install, once per session
    start_stack: Callable[[str, Any, pathlib.Path], EngineStack[Any]]  # (name, install, log dir)
    # What the terminal summary prints of the measurements (default: one line each).
    summary: Callable[[Measurements], list[str]] = Measurements.lines
    measurements_key: pytest.StashKey[Measurements] = field(default_factory=pytest.StashKey)

    @property
    def enabled(self) -> bool:
        return os.environ.get(f"TETHER_{self.variable}_TESTS") == "1"

    @property
    def skip_reason(self) -> str:
        return (
            f"real {self.engine} suite is opt-in: set TETHER_{self.variable}_TESTS=1 "
            f"(see tests/{self.directory.name}/README.md)"
        )

    def configure(self, config: pytest.Config) -> None:
        """`pytest_configure`: declare the marker."""
        config.addinivalue_line(
            "markers",
            f"{self.marker}: runs against {self.description}; needs TETHER_{self.variable}_TESTS=1",
        )

    def prepare(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        """`pytest_collection_modifyitems`: mark, bound, skip unless enabled, order."""
        prepare_suite(
            config,
            items,
            suite_dir=self.directory,
            marker=getattr(pytest.mark, self.marker),
            configurations=self.configurations,
            skip_reason=None if self.enabled else self.skip_reason,
        )

    def new_measurements(self, config: pytest.Config) -> Measurements:
        found = Measurements(f"TETHER_{self.variable}_MEASUREMENTS")
        config.stash[self.measurements_key] = found
        return found

    def log_dir(self, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
        return suite_log_dir(
            f"TETHER_{self.variable}_LOG_DIR", tmp_path_factory, f"{self.directory.name}_logs"
        )

    def report(self, terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
        """`pytest_terminal_summary`: the measurements, if any were taken."""
        found = config.stash.get(self.measurements_key, None)
        if found is not None and found.rows:
            terminalreporter.section(f"real {self.engine} measurements")
            for line in self.summary(found):
                terminalreporter.write_line(line)


def _config_of(item: pytest.Item) -> str:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "stack" in callspec.params:
        return str(callspec.params["stack"])
    return ""


def prepare_suite(
    config: pytest.Config,
    items: list[pytest.Item],
    *,
    suite_dir: pathlib.Path,
    marker: pytest.MarkDecorator,
    configurations: Iterable[str],
    skip_reason: str | None,
) -> None:
    """Mark the suite's items (skipped with `skip_reason` unless it is None) and order them
    by configuration, stably, in the places they already hold among `items`."""
    ours = [item for item in items if suite_dir in pathlib.Path(str(item.path)).parents]
    if not ours:
        return
    order = list(configurations)
    for item in ours:
        item.add_marker(marker)
        if config.pluginmanager.hasplugin("timeout"):
            item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))
        if skip_reason is not None:
            item.add_marker(pytest.mark.skip(reason=skip_reason))
    positions = [index for index, item in enumerate(items) if item in ours]
    ranked = sorted(
        ours, key=lambda item: order.index(_config_of(item)) if _config_of(item) in order else -1
    )
    for index, item in zip(positions, ranked, strict=True):
        items[index] = item
