"""The stages CI runs the tests in, the rule that puts every test in exactly one, and the
guard that keeps the `socket_free` marker's promise.

A test's stage comes from its markers: `socket_free` (a unit test that opens no socket and
starts no process: CI runs these first, in seconds, so a broken build fails fast), a real
engine's (`vllm`, `sglang`, `llamacpp`: their suites, each with its engine), `soak` (by hand),
and every other test is in `sockets` (tether, engines and clients on loopback, real
processes). `python -m pytest --stage NAME` runs one stage. Every run checks that each test
it collected is in exactly one stage, and `tests/test_stages.py` that CI runs every stage but
the soak, so no test can fall between stages.

A `socket_free` test that binds, listens or connects a socket, or starts a process, fails
(`NotSocketFreeError`), wherever it runs: the marker cannot put a test that needs the machine
among the ones meant to finish in seconds.
"""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Callable, Generator, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

SOCKET_FREE = "socket_free"
SOCKETS = "sockets"
SOAK = "soak"
REAL_ENGINES = ("vllm", "sglang", "llamacpp")
# Every stage, in the order CI runs them; the soak is run by hand (`pytest -m soak`).
STAGES = (SOCKET_FREE, SOCKETS, *REAL_ENGINES, SOAK)
# The markers that name a stage; a test with none of them is in SOCKETS.
STAGE_MARKERS = frozenset({SOCKET_FREE, SOAK, *REAL_ENGINES})


class NotSocketFreeError(AssertionError):
    """A `socket_free` test used a socket or started a process."""


def stages_of(marker_names: Iterable[str]) -> list[str]:
    """The stages a test with these markers is in: one, unless its markers contradict."""
    named = sorted(STAGE_MARKERS.intersection(marker_names))
    return named or [SOCKETS]


def misplaced(tests: Iterable[tuple[str, Iterable[str]]]) -> list[str]:
    """`node ID: stages` for every (node ID, marker names) that is not in exactly one stage."""
    found = []
    for node_id, marker_names in tests:
        stages = stages_of(marker_names)
        if len(stages) != 1:
            found.append(f"{node_id}: {', '.join(stages)}")
    return found


@contextmanager
def no_sockets_or_processes(used: list[str]) -> Iterator[None]:
    """Inside, binding, listening on or connecting a socket and starting a process raise
    `NotSocketFreeError`, and each attempt is appended to `used` (so that one swallowed by
    the code under test still fails the test). The event loop's own wake-up socket pair is
    made without any of these, so asyncio runs as usual."""

    def refuse(what: str) -> Callable[..., Any]:
        def refused(*args: object, **kwargs: object) -> Any:
            used.append(what)
            raise NotSocketFreeError(f"a socket_free test used {what}")

        return refused

    with pytest.MonkeyPatch.context() as patch:
        for method in ("bind", "listen", "connect", "connect_ex"):
            patch.setattr(socket.socket, method, refuse(f"socket.{method}"))
        patch.setattr(subprocess.Popen, "_execute_child", refuse("a subprocess"))
        for spawn in ("fork", "posix_spawn", "posix_spawnp", "system"):
            patch.setattr(os, spawn, refuse(f"os.{spawn}"))
        yield


class StagePlugin:
    """The pytest hooks: `--stage` selects a stage, every run checks that each collected test
    is in exactly one, and `socket_free` tests run inside the guard (their fixtures too)."""

    def __init__(self, stage: str | None) -> None:
        self._stage = stage

    @pytest.hookimpl(trylast=True)  # after the real-engine suites have marked their tests
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        marked = [(item, [mark.name for mark in item.iter_markers()]) for item in items]
        wrong = misplaced((item.nodeid, names) for item, names in marked)
        if wrong:
            raise pytest.UsageError(
                "tests not in exactly one stage (tests/support/stages.py):\n  " + "\n  ".join(wrong)
            )
        if self._stage is None:
            return
        selected = [item for item, names in marked if stages_of(names) == [self._stage]]
        if len(selected) < len(items):
            config.hook.pytest_deselected(items=[item for item in items if item not in selected])
            items[:] = selected

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_setup(self, item: pytest.Item) -> Generator[None, object, object]:
        return (yield from _guarded(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, object, object]:
        return (yield from _guarded(item))

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_teardown(self, item: pytest.Item) -> Generator[None, object, object]:
        return (yield from _guarded(item))


def _guarded(item: pytest.Item) -> Generator[None, object, object]:
    """One phase of a test (setup, call, teardown); inside the guard if it is `socket_free`."""
    if item.get_closest_marker(SOCKET_FREE) is None:
        return (yield)
    used: list[str] = []
    with no_sockets_or_processes(used):
        result = yield
    if used:
        raise NotSocketFreeError(
            f"a socket_free test used {', '.join(used)}: take the marker off (it then runs in "
            f"the `{SOCKETS}` stage) or take the socket out"
        )
    return result
