"""Collection rules shared by the real-engine suites (vLLM here, SGLang beside it).

Each suite is opt-in, gets its marker and a timeout sized for an engine's start, and has its
tests ordered by the engine configuration they need, so each configuration starts once.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterable

import pytest

# Seconds one test may take, the engine's start (up to a minute on a loaded machine)
# included; the repository's default pytest-timeout is sized for unit tests.
TEST_TIMEOUT = 600


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
