"""smg (SGLang's model gateway, `pip install smg`) as the router in front of a worker: tether
or an engine. The tests that put tether behind a real router start it through here.

smg registers a worker only once the worker's `/v1/models` answers, then health-checks its
`/health`; its `/readiness` answers 200 once it has a healthy worker, which is when a test
may send it requests.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp

from .net import free_ports
from .waiting import poll_until

READY_TIMEOUT = 30.0
EXIT_TIMEOUT = 10.0
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
    beside = Path(sys.executable).parent / "smg"
    if beside.exists():
        return str(beside)
    return shutil.which("smg")


def smg_command(
    worker_url: str, port: int, metrics_port: int, extra: Sequence[str] = ()
) -> list[str]:
    """`smg launch` as README's "Fleets" section runs it: one worker, round robin, loopback."""
    executable = smg_executable()
    assert executable is not None, SKIP_REASON
    return [
        executable,
        "launch",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        worker_url,
        "--policy",
        "round_robin",
        "--log-level",
        "warn",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(metrics_port),
        # A test's smg stops at once (its default grace, 180 s, waits 5 s even when idle).
        "--shutdown-grace-period-secs",
        "0",
        *extra,
    ]


@dataclass(frozen=True)
class Smg:
    """A running smg: where clients reach it."""

    port: int
    worker_url: str

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@asynccontextmanager
async def smg_in_front_of(worker_url: str, *extra: str) -> AsyncIterator[Smg]:
    """smg routing to `worker_url` (further `smg launch` options in `extra`), yielded once its
    `/readiness` says it has a healthy worker; stopped on exit."""
    port, metrics_port = free_ports(2)
    with tempfile.TemporaryFile() as output:
        process = await asyncio.create_subprocess_exec(
            *smg_command(worker_url, port, metrics_port, extra),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=output,
            stderr=asyncio.subprocess.STDOUT,
        )
        try:
            await _wait_ready(process, f"http://127.0.0.1:{port}/readiness", output)
            yield Smg(port, worker_url)
        finally:
            if process.returncode is None:
                process.terminate()
            await asyncio.wait_for(process.wait(), EXIT_TIMEOUT)


async def _wait_ready(process: asyncio.subprocess.Process, probe: str, output: IO[bytes]) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:

        async def ready() -> bool:
            if process.returncode is not None:
                raise AssertionError(f"smg exited ({process.returncode}):\n{_text(output)}")
            async with session.get(probe) as response:
                return response.status == 200

        await poll_until(
            ready,
            READY_TIMEOUT,
            interval=0.05,
            what=f"{probe} to answer 200 (smg registered its worker)",
            ignoring=(aiohttp.ClientError, TimeoutError),
        )


def _text(output: IO[bytes]) -> str:
    """The end of what smg printed (its log goes to a temporary file)."""
    output.seek(0)
    return output.read().decode(errors="replace")[-4000:]
