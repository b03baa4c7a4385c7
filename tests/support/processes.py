"""Processes a test starts, one toolkit for both kinds of suite.

- In the test's event loop (the in-process suite): the real `tether` (`start_tether_process`,
  its output kept for the test and copied line by line into the run's collected log) and the
  fake engine (`start_engine_process`), each returned once it answers its probe or failed
  early with what it printed (`TetherProcess.events` and `wait_event` read its JSON log
  lines, its workers' too); `run_tether_cli` for a `tether` run to its end. The
  `tether_process` and `engine_process` fixtures in `tests/conftest.py` stop whatever a test
  left running.
- Blocking (the real-engine suites, whose clients run in threads, and smg): `spawn` a command in its
  own session with its output in a log file (`LogFile`, read from a mark), `Process.wait_ready`
  for its probe, `on_core` to pin it to one core, `Process.stop` to end it and its children.

`tether_environment` is what both kinds run tether with: this environment without any
TETHER_* setting, plus the test's.
"""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp

from proxy.compiled import NO_EXTENSIONS_VARIABLE

from .blocking_http import http_get
from .collected_log import CLI, CollectedLog, subprocess_source
from .net import free_port, free_ports
from .waiting import poll_until, wait_until

READY_TIMEOUT = 15.0
EXIT_TIMEOUT = 10.0


def tether_environment(**env: str) -> dict[str, str]:
    """This process's environment without any TETHER_* setting, plus `env`. The switch to
    the pure-Python modules is no setting and stays: a run on the pure path starts its
    tethers on it too."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("TETHER_") or k == NO_EXTENSIONS_VARIABLE
    }
    return {**clean, **env}


@dataclass(eq=False)
class TetherProcess:
    """`python -m proxy` started by a test."""

    process: asyncio.subprocess.Process
    port: int
    admin_port: int
    _log: CollectedLog
    host: str = "127.0.0.1"
    _output: list[str] = field(default_factory=list)
    _pump: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def url(self, path: str = "/v1/chat/completions") -> str:
        return f"http://{self.host}:{self.port}{path}"

    def admin_url(self, path: str) -> str:
        return f"http://{self.host}:{self.admin_port}{path}"

    def output(self) -> str:
        """Everything the process printed so far (complete lines)."""
        return "".join(self._output)

    def events(self, event: str) -> list[dict[str, Any]]:
        """Its JSON log lines of `event` so far (the workers' lines too: they share its
        stdout)."""
        found = []
        for line in self.output().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") == event:
                found.append(entry)
        return found

    async def wait_event(
        self, event: str, timeout: float = EXIT_TIMEOUT, **fields: object
    ) -> dict[str, Any]:
        """The first JSON line of `event` with these field values, waiting up to `timeout`."""

        def logged() -> dict[str, Any] | None:
            for entry in self.events(event):
                if all(entry.get(key) == value for key, value in fields.items()):
                    return entry
            return None

        return await poll_until(logged, timeout, interval=0.02, what=f"{event} {fields} logged")

    def send_signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait_exit(self, timeout: float = EXIT_TIMEOUT) -> int:
        """Its exit code, once it exited and its output is read to the end."""
        async with asyncio.timeout(timeout):
            code = await self.process.wait()
            if self._pump is not None:
                await self._pump
        return code

    async def stop(self, signum: int = signal.SIGTERM, timeout: float = EXIT_TIMEOUT) -> int:
        """Signal it and wait for its exit code."""
        if self.process.returncode is None:
            self.send_signal(signum)
        return await self.wait_exit(timeout)

    async def close(self) -> None:
        """Kill it if it still runs (test teardown)."""
        if self.process.returncode is None:
            self.process.kill()
        await self.wait_exit()

    def _start_pump(self) -> None:
        self._pump = asyncio.get_running_loop().create_task(self._read_output())

    async def _read_output(self) -> None:
        assert self.process.stdout is not None
        source = subprocess_source(self.pid)
        partial = b""
        # Chunks, not readline(): a line may be longer than a StreamReader's line limit.
        while chunk := await self.process.stdout.read(65536):
            complete, newline, partial = (partial + chunk).rpartition(b"\n")
            if newline:
                text = complete.decode(errors="backslashreplace") + "\n"
                self._output.append(text)
                self._log.add_lines(source, text)
        if partial:
            text = partial.decode(errors="backslashreplace")
            self._output.append(text)
            self._log.add_lines(source, text)


class TetherProcessFactory(Protocol):
    """The `tether_process` fixture: `start_tether_process(engine_url, log, env)`."""

    def __call__(self, engine_url: str, **env: str) -> Awaitable[TetherProcess]: ...


async def start_tether_process(
    engine_url: str,
    log: CollectedLog,
    env: Mapping[str, str] | None = None,
    *,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    ready_timeout: float = READY_TIMEOUT,
) -> TetherProcess:
    """`python -m proxy` in front of `engine_url`, both its ports on `host` (free ports unless
    `env` sets TETHER_PORT / TETHER_ADMIN_PORT; with 0 the port is read from its
    `tether_started` line), with the TETHER_* settings in `env` on top of test defaults (fast
    health checks, no repeated abort); returns once `/readyz` is 200.
    `prefix` runs it under another command (e.g. `unshare` for a private /etc/hosts)."""
    # Distinct from each other and from a port the test chose itself (asked one by one, the
    # kernel may hand out the same port twice).
    chosen = {(env or {}).get(name) for name in ("TETHER_PORT", "TETHER_ADMIN_PORT")}
    port, admin_port = [p for p in free_ports(4) if str(p) not in chosen][:2]
    settings = {
        "TETHER_UPSTREAM_URL": engine_url,
        "TETHER_HOST": host,
        "TETHER_PORT": str(port),
        "TETHER_ADMIN_HOST": host,
        "TETHER_ADMIN_PORT": str(admin_port),
        "TETHER_HEALTH_INTERVAL": "0.1",
        "TETHER_ABORT_REPEAT_DELAY": "0",
        **(env or {}),
    }
    process = await asyncio.create_subprocess_exec(
        *prefix,
        sys.executable,
        "-m",
        "proxy",
        env=tether_environment(**settings),
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    port, admin_port = int(settings["TETHER_PORT"]), int(settings["TETHER_ADMIN_PORT"])
    tether = TetherProcess(process, port, admin_port, log, host)
    tether._start_pump()
    try:
        if admin_port == 0:  # the line comes before readiness: only then is the port known
            started = await tether.wait_event("tether_started", ready_timeout)
            tether.admin_port = int(started["admin_port"])
        await _wait_ready(process, tether.admin_url("/readyz"), ready_timeout, tether.output)
        if port == 0:
            tether.port = int((await tether.wait_event("tether_started"))["port"])
    except BaseException:
        await tether.close()
        raise
    return tether


@dataclass(eq=False)
class EngineProcess:
    """The fake engine (`python -m tether_fake_engine`) started by a test."""

    process: asyncio.subprocess.Process
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def close(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
        await asyncio.wait_for(self.process.wait(), EXIT_TIMEOUT)


class EngineProcessFactory(Protocol):
    """The `engine_process` fixture: `start_engine_process(*args)`."""

    def __call__(self, *args: str) -> Awaitable[EngineProcess]: ...


async def start_engine_process(*args: str, ready_timeout: float = READY_TIMEOUT) -> EngineProcess:
    """The fake engine with these command-line options on a free port; returns once its
    `/health` answers 200."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tether_fake_engine",
        "--port",
        str(port),
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    engine = EngineProcess(process, port)
    try:
        await _wait_ready(process, f"{engine.url}/health", ready_timeout, lambda: "")
    except BaseException:
        await engine.close()
        raise
    return engine


def run_tether_cli(
    log: CollectedLog,
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> subprocess.CompletedProcess[str]:
    """`python -m proxy ARGS` run to its end with only `env` as TETHER_* settings, outside
    the repository (no stray .env); its output also goes to the collected log."""
    result = subprocess.run(
        [sys.executable, "-m", "proxy", *args],
        env=tether_environment(**(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd="/",
        stdin=subprocess.DEVNULL,
    )
    log.add_lines(CLI, result.stdout)
    log.add_lines(CLI, result.stderr)
    return result


async def _wait_ready(
    process: asyncio.subprocess.Process,
    probe: str,
    timeout: float,
    output: Callable[[], str],
) -> None:
    """Poll `probe` until it answers 200 (the process offers no other readiness signal);
    fail at once, with the process's output, if it exits first."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:

        async def ready() -> bool:
            if process.returncode is not None:
                raise AssertionError(
                    f"{probe}: the process exited ({process.returncode}) before it was ready:\n"
                    f"{output()}"
                )
            async with session.get(probe) as response:
                return response.status == 200

        await poll_until(
            ready,
            timeout,
            interval=0.05,
            what=f"{probe} to answer 200",
            ignoring=(aiohttp.ClientError, TimeoutError),
        )


# --- blocking: the real-engine suites' processes --------------------------------------------


def on_core(core: int) -> list[str]:
    """`taskset -c <core>` when the machine has that core and taskset, else nothing."""
    if shutil.which("taskset") and (os.cpu_count() or 1) > core:
        return ["taskset", "-c", str(core)]
    return []


class LogFile:
    """A log file another process writes; tests read what was appended after a mark."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path

    def mark(self) -> int:
        return self.path.stat().st_size if self.path.exists() else 0

    def text_since(self, mark: int) -> str:
        with self.path.open("rb") as handle:
            handle.seek(mark)
            return handle.read().decode(errors="replace")

    def find_since(self, mark: int, pattern: str) -> list[re.Match[str]]:
        return list(re.finditer(pattern, self.text_since(mark), re.MULTILINE))

    def wait_for(self, mark: int, pattern: str, timeout: float = 10.0) -> re.Match[str]:
        """The first match of `pattern` written after `mark`, waiting up to `timeout`."""
        found: list[re.Match[str]] = []

        def appeared() -> bool:
            found[:] = self.find_since(mark, pattern)
            return bool(found)

        wait_until(appeared, timeout, f"{pattern!r} in {self.path.name}", interval=0.02)
        return found[0]

    def json_lines(self, mark: int, event: str | None = None) -> list[dict[str, Any]]:
        """The JSON log lines (tether's) written after `mark`, only those of `event` if given."""
        found = []
        for line in self.text_since(mark).splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and (event is None or entry.get("event") == event):
                found.append(entry)
        return found

    def wait_json(
        self, mark: int, event: str, timeout: float = 10.0, **fields: object
    ) -> dict[str, Any]:
        """The first JSON line of `event` with these field values written after `mark`,
        waiting up to `timeout`."""
        found: list[dict[str, Any]] = []

        def appeared() -> bool:
            found[:] = [
                entry
                for entry in self.json_lines(mark, event)
                if all(entry.get(key) == value for key, value in fields.items())
            ]
            return bool(found)

        wait_until(appeared, timeout, f"{event} {fields} in {self.path.name}", interval=0.02)
        return found[0]

    def tail(self, lines: int = 60) -> str:
        if not self.path.exists():
            return "(no log)"
        return "\n".join(self.path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class Process:
    """A child process in its own session, logging to a file."""

    popen: subprocess.Popen[bytes]
    log: LogFile

    def alive(self) -> bool:
        return self.popen.poll() is None

    def wait_ready(self, url: str, timeout: float, what: str, interval: float = 0.2) -> float:
        """Poll `url` until it answers 200; the seconds it took. Fails early, with the log's
        tail, if the process dies; stops the process when it fails."""

        def ready() -> bool:
            if not self.alive():
                raise AssertionError(f"{what} exited ({self.popen.returncode}):\n{self.log.tail()}")
            try:
                return http_get(url, timeout=2.0)[0] == 200
            except OSError:
                return False

        try:
            return wait_until(ready, timeout, f"{what} at {url}", interval=interval)
        except AssertionError:
            self.stop()
            raise

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to its session, SIGKILL after `timeout` seconds."""
        if not self.alive():
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


def spawn(argv: list[str], env: Mapping[str, str], log_path: pathlib.Path) -> Process:
    """`argv` in a session of its own, stdout and stderr into `log_path` (made afresh)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return Process(popen, LogFile(log_path))
