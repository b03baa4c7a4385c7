"""A real engine with tether in front of it: the engines' setup scripts, the engine and the
stack both suites' own types build on, the pool that keeps one stack running, and where they
log."""

from __future__ import annotations

import os
import pathlib
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import pytest

from ..processes import LogFile, Process
from .measurements import Measurements
from .tether import Tether

REPO = pathlib.Path(__file__).resolve().parents[3]
ENGINE_SCRIPTS = REPO / "tests" / "engines"
# What both engines serve the tiny model (tests/engines/tiny_model.sh) as.
MODEL_NAME = "tiny"


def run_setup_script(name: str) -> dict[str, str]:
    """Run a setup script of tests/engines (idempotent and cached: well under a second once
    built) and read the `NAME=value` assignments of its last line."""
    result = subprocess.run(
        ["bash", str(ENGINE_SCRIPTS / name)],
        check=True,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    return dict(item.split("=", 1) for item in result.stdout.strip().splitlines()[-1].split())


class EngineConfig(Protocol):
    """One way of running an engine (`VllmConfig`, `SglangConfig`); each is started once per
    session."""

    @property
    def name(self) -> str: ...


ConfigT = TypeVar("ConfigT", bound=EngineConfig)


@dataclass
class EngineServer(Generic[ConfigT]):
    """A real engine the suite started in one configuration, listening on loopback."""

    config: ConfigT
    port: int
    process: Process
    ready_seconds: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> LogFile:
        return self.process.log


ServerT = TypeVar("ServerT", bound=EngineServer[Any])


@dataclass
class EngineStack(Generic[ServerT]):
    """A real engine with tether in front of it (each suite's `Stack` names the engine after
    itself: `stack.vllm`, `stack.sglang`)."""

    engine: ServerT
    tether: Tether

    @property
    def name(self) -> str:
        return str(self.engine.config.name)

    @property
    def engine_ready_seconds(self) -> float:
        return self.engine.ready_seconds

    def stop(self) -> None:
        self.tether.process.stop()
        self.engine.process.stop()


StackT = TypeVar("StackT", bound=EngineStack[Any])


def in_front_of(
    engine: ServerT,
    start_tether: Callable[[ServerT], Tether],
    stack: Callable[[ServerT, Tether], StackT],
) -> StackT:
    """`stack(engine, start_tether(engine))`: tether in front of a started engine, which is
    stopped if tether does not start."""
    try:
        tether = start_tether(engine)
    except BaseException:
        engine.process.stop()
        raise
    return stack(engine, tether)


class StackPool(Generic[StackT]):
    """Keeps at most one stack running (two engines would fight over one core); `start`
    starts the stack of a configuration by its name."""

    def __init__(self, start: Callable[[str], StackT]) -> None:
        self._start = start
        self._current: StackT | None = None
        self.started: list[tuple[str, float, float]] = []
        self.tether_error_lines: dict[str, int] = {}

    def get(self, name: str) -> StackT:
        if self._current is not None and self._current.name == name:
            return self._current
        self.close()
        started = time.monotonic()
        self._current = stack = self._start(name)
        self.started.append((name, stack.engine_ready_seconds, time.monotonic() - started))
        return stack

    def close(self) -> None:
        stack, self._current = self._current, None
        if stack is not None:
            log = stack.tether.log.text_since(0)
            self.tether_error_lines[stack.name] = log.count('"level": "error"')
            stack.stop()

    def report(self, measurements: Measurements, engine: str) -> None:
        """Start-up times and tether's error-level lines of every stack that ran."""
        for name, engine_ready, total in self.started:
            measurements.add("startup", f"{engine} {name} ready (s)", engine_ready)
            measurements.add("startup", f"{engine} {name} + tether ready (s)", total)
        for name, count in self.tether_error_lines.items():
            measurements.add("tether log", f"{name}: error-level lines in tether's log", count)


def suite_log_dir(
    variable: str, tmp_path_factory: pytest.TempPathFactory, default_name: str
) -> pathlib.Path:
    """Where a suite keeps the engine's and tether's logs: `variable`'s directory when set
    (CI prints the logs of a failed run from there), else a pytest temporary directory."""
    configured = os.environ.get(variable)
    if configured:
        path = pathlib.Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp(default_name)
