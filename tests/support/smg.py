"""smg (SGLang's model gateway, `pip install smg`) as the router in front of a worker: tether
or an engine. Every test that puts tether behind a real router starts it through here, the
in-process suite (`start_smg` in a thread) as the real-engine suites (`smg_process`, and their
`router` fixture in front of the stack's tether).

smg registers a worker only once the worker's `/v1/models` answers, then health-checks its
`/health`; its `/readiness` answers 200 once it has a healthy worker, which is when a test
may send it requests.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from bench.systems import console_script, smg_launch

from .net import free_ports
from .processes import Process, on_core, spawn

READY_TIMEOUT = 30.0
READY_INTERVAL = 0.05
SKIP_REASON = "smg (SGLang model gateway) is not installed: pip install -e '.[test]' has it"
# What operators run a health-checked router with, but probing every second (smg's default
# is a minute) so a test sees a worker go unhealthy and come back within seconds.
FAST_HEALTH_CHECKS = (
    "--health-check-interval-secs",
    "1",
    "--health-failure-threshold",
    "1",
    "--health-success-threshold",
    "1",
)


def smg_executable() -> str | None:
    """The `smg` console script beside the running Python (a venv not on PATH), else on PATH."""
    return console_script("smg")


def smg_command(
    worker_url: str, port: int, metrics_port: int, extra: Sequence[str] = ()
) -> list[str]:
    """`smg launch` as the docs' Fleets page runs it (one worker, round robin, loopback), as
    the bench does, with `extra` options after."""
    executable = smg_executable()
    assert executable is not None, SKIP_REASON
    return [*smg_launch(executable, worker_url, port, metrics_port), *extra]


@dataclass
class Smg:
    """A running smg: where clients reach it, and its process."""

    port: int
    worker_url: str
    process: Process

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def stop(self) -> None:
        self.process.stop()


def start_smg(worker_url: str, log_path: pathlib.Path, *extra: str, core: int | None = None) -> Smg:
    """smg routing to `worker_url` (further `smg launch` options in `extra`), logging to
    `log_path`, pinned to `core` if given; returned once its `/readiness` says it has a
    healthy worker. Blocking: a test whose worker runs in its event loop calls it in a thread
    (smg must reach the worker to register it)."""
    port, metrics_port = free_ports(2)
    argv = [
        *(on_core(core) if core is not None else []),
        *smg_command(worker_url, port, metrics_port, extra),
    ]
    process = spawn(argv, dict(os.environ), log_path)
    process.wait_ready(
        f"http://127.0.0.1:{port}/readiness", READY_TIMEOUT, "smg", interval=READY_INTERVAL
    )
    return Smg(port, worker_url, process)


@contextmanager
def smg_process(worker_url: str, log_path: pathlib.Path, *extra: str) -> Iterator[Smg]:
    """`start_smg` on core 0 (the real-engine suites: the engine has core 1), stopped on
    exit."""
    smg = start_smg(worker_url, log_path, *extra, core=0)
    try:
        yield smg
    finally:
        smg.stop()


def smg_log(log_dir: pathlib.Path, request: pytest.FixtureRequest, what: str) -> pathlib.Path:
    """Where the log of an smg a test starts in front of `what` (tether, the engine) goes."""
    return log_dir / f"smg-{request.node.name}-{what}.log".replace("/", "_")
