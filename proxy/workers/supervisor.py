"""TETHER_WORKERS > 1: the supervisor starts the workers, watches them, restarts one that
exits, and stops them all at shutdown.

Each worker is `python -m proxy.workers.worker` (a fresh interpreter, not a fork: nothing of the
supervisor's event loop or sockets leaks into it) with the supervisor's environment. It
listens on the client port itself (SO_REUSEPORT); the supervisor keeps a socket bound to that
port, never listening, for its whole life, so the port it resolved (TETHER_PORT=0) stays
reserved while a worker restarts. The workers share the supervisor's stdout, and hold the
read end of a pipe whose write end only the supervisor has: when the supervisor is gone,
however it died, they read end of file and shut down gracefully.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import structlog
from prometheus_client.metrics_core import Metric

from ..server.runner import tcp_socket
from ..settings import Settings
from ..wire.callers import KEY_BYTES
from . import metrics_sum
from .client import WorkerAdmin

log = structlog.get_logger("tether.supervisor")

# A worker imports tether and starts its servers within this, even on a loaded machine.
START_TIMEOUT_SECONDS = 30.0
_START_POLL_SECONDS = 0.02
# Restarts back off from the first delay, doubling up to the last, so a worker that cannot
# start (its engine's address gone bad) does not spin; one that ran this long starts over.
RESTART_FIRST_DELAY = 0.5
RESTART_MAX_DELAY = 30.0
RESTART_RESET_AFTER = 60.0
# A worker's graceful stop takes TETHER_SHUTDOWN_GRACE, then its cancelled handlers settle
# and its aborts drain (server.runner.TetherServer.stop); past this margin on top it is killed.
STOP_MARGIN_SECONDS = 15.0


class StartupError(Exception):
    """tether could not start: the message says why (not an answer to a request, so not a
    `TetherError`)."""


@contextlib.contextmanager
def reserved_port(host: str, port: int) -> Iterator[int]:
    """Bind (never listen on) `host:port` with SO_REUSEPORT for as long as the block runs;
    yields the port, resolved when 0. Bound but not listening, the socket is handed no
    connections, and the workers' listening sockets can join it on the same port."""
    sock = tcp_socket(host, reuse_port=True)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise StartupError(
            f"TETHER_HOST:TETHER_PORT {host}:{port} cannot be used: {exc.strerror or exc}"
        ) from None
    with sock:
        yield int(sock.getsockname()[1])


@dataclass(eq=False)
class Worker:
    """One worker's seat: its index and admin socket outlive its processes."""

    index: int
    admin: WorkerAdmin
    admin_socket: str
    process: asyncio.subprocess.Process | None = None
    # Started, and its admin app answered: it serves (or will, once its engine is ready).
    running: bool = False
    started_at: float = 0.0
    restarts: int = 0
    # Its metrics at the last scrape, left to the sums when it exits.
    last_metrics: list[Metric] = field(default_factory=list)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None


class Supervisor:
    """The workers' processes."""

    def __init__(self, settings: Settings, port: int, lifeline: int, workers: list[Worker]) -> None:
        self._settings = settings
        self.port = port
        self._lifeline = lifeline
        self.workers = workers
        self.stopping = False
        self.restarts = 0
        # What exited workers counted, so the sums over workers never go down.
        self.retired_metrics: list[Metric] = []
        self._watchers: list[asyncio.Task[None]] = []
        # The key the workers hash callers with (`wire.callers`): one for all of them and for
        # their restarts, so that a cancel reaching any worker matches a request on another.
        # With an admin token each derives it from that instead.
        self._caller_key = os.urandom(KEY_BYTES)

    @classmethod
    @asynccontextmanager
    async def open(
        cls, settings: Settings, count: int, port: int, runtime_dir: str
    ) -> AsyncIterator[Supervisor]:
        """Start `count` workers on `port` and wait until each answers; they are stopped
        when the block ends. `runtime_dir` (private to this user) holds their admin sockets."""
        lifeline_read, lifeline_write = os.pipe()
        async with AsyncExitStack() as stack:
            stack.callback(os.close, lifeline_write)
            stack.callback(os.close, lifeline_read)
            workers = []
            for index in range(count):
                path = os.path.join(runtime_dir, f"worker-{index}.sock")
                admin = await stack.enter_async_context(WorkerAdmin.open(index, path))
                workers.append(Worker(index, admin, path))
            supervisor = cls(settings, port, lifeline_read, workers)
            try:
                await supervisor._start()
                yield supervisor
            finally:
                await supervisor.stop()

    @property
    def running(self) -> int:
        return sum(1 for worker in self.workers if worker.running)

    async def _start(self) -> None:
        for worker in self.workers:
            await self._spawn(worker)
        failures = await asyncio.gather(*(self._until_answering(w) for w in self.workers))
        problems = [problem for problem in failures if problem is not None]
        if problems:
            raise StartupError("; ".join(problems))
        loop = asyncio.get_running_loop()
        self._watchers = [
            loop.create_task(self._watch(worker), name=f"worker-{worker.index}")
            for worker in self.workers
        ]

    async def _spawn(self, worker: Worker) -> None:
        # The caller key goes through a pipe: never in the environment or the command line,
        # which other processes can read.
        key_read, key_write = os.pipe()
        try:
            os.write(key_write, self._caller_key)
            os.close(key_write)
            await self._spawn_with(worker, key_read)
        finally:
            os.close(key_read)
            with contextlib.suppress(OSError):
                os.close(key_write)

    async def _spawn_with(self, worker: Worker, key_fd: int) -> None:
        worker.process = await asyncio.create_subprocess_exec(
            sys.executable,
            # -P: the working directory stays off the module path, so a `proxy` directory
            # there (nginx makes one for its temporary files) cannot stand in for tether.
            "-P",
            "-m",
            "proxy.workers.worker",
            "--index",
            str(worker.index),
            "--port",
            str(self.port),
            "--admin-socket",
            worker.admin_socket,
            "--lifeline-fd",
            str(self._lifeline),
            "--caller-key-fd",
            str(key_fd),
            *(
                argument
                for other in self.workers
                if other is not worker
                for argument in ("--sibling-socket", other.admin_socket)
            ),
            pass_fds=(self._lifeline, key_fd),
            stdin=asyncio.subprocess.DEVNULL,
        )
        worker.started_at = asyncio.get_running_loop().time()

    async def _until_answering(self, worker: Worker) -> str | None:
        """Wait until the worker's admin app answers; None then, else what went wrong (it
        exited, or did not answer in time: then it is killed)."""
        process = worker.process
        assert process is not None
        try:
            async with asyncio.timeout(START_TIMEOUT_SECONDS):
                while not await worker.admin.answers():
                    if process.returncode is not None:
                        how = exit_text(process.returncode)
                        return f"worker {worker.index} exited while starting ({how})"
                    await asyncio.sleep(_START_POLL_SECONDS)
        except TimeoutError:
            process.kill()
            await process.wait()
            return f"worker {worker.index} did not answer within {START_TIMEOUT_SECONDS:.0f} s"
        worker.running = True
        log.info("worker_ready", index=worker.index, pid=process.pid)
        return None

    async def _watch(self, worker: Worker) -> None:
        """Restart the worker whenever it exits, with a backoff, until shutdown."""
        loop = asyncio.get_running_loop()
        delay = RESTART_FIRST_DELAY
        while True:
            assert worker.process is not None
            code = await worker.process.wait()
            worker.running = False
            self._retire(worker)
            log.error(
                "worker_exited", index=worker.index, pid=worker.process.pid, **exit_facts(code)
            )
            if loop.time() - worker.started_at >= RESTART_RESET_AFTER:
                delay = RESTART_FIRST_DELAY
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_DELAY)
            try:
                await self._spawn(worker)
            except OSError as exc:
                # The old, exited process stays: the next round waits the longer delay.
                log.error("worker_restart_failed", index=worker.index, reason=str(exc))
                continue
            problem = await self._until_answering(worker)
            if problem is not None:
                log.error("worker_restart_failed", index=worker.index, reason=problem)
                continue
            worker.restarts += 1
            self.restarts += 1
            log.info(
                "worker_restarted",
                index=worker.index,
                pid=worker.pid,
                restarts=worker.restarts,
            )

    def _retire(self, worker: Worker) -> None:
        """Keep what the exited worker counted (as of its last scrape) in the sums."""
        if worker.last_metrics:
            self.retired_metrics = list(
                metrics_sum.summed(
                    [metrics_sum.cumulative(worker.last_metrics)], self.retired_metrics
                )
            )
            worker.last_metrics = []

    async def stop(self) -> None:
        """SIGTERM every worker (each drains as one tether does), wait for all to exit within
        the grace period and a margin, then SIGKILL what is left. No restarts from here on.
        Idempotent."""
        if self.stopping:
            return
        self.stopping = True
        for watcher in self._watchers:
            watcher.cancel()
        for watcher in self._watchers:
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        alive = [w for w in self.workers if w.process is not None and w.process.returncode is None]
        for worker in alive:
            assert worker.process is not None
            worker.process.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(self._settings.shutdown_grace + STOP_MARGIN_SECONDS):
                await asyncio.gather(*(self._stopped(worker) for worker in alive))
        except TimeoutError:
            left = [w for w in alive if w.process is not None and w.process.returncode is None]
            log.error("workers_killed", indexes=[w.index for w in left])
            for worker in left:
                assert worker.process is not None
                worker.process.kill()
                await worker.process.wait()

    async def _stopped(self, worker: Worker) -> None:
        assert worker.process is not None
        code = await worker.process.wait()
        worker.running = False
        level = log.info if code == 0 else log.warning
        level("worker_stopped", index=worker.index, pid=worker.process.pid, **exit_facts(code))


def exit_facts(returncode: int) -> dict[str, object]:
    """How a process ended, as log fields: its exit code, or the signal that killed it."""
    if returncode < 0:
        return {"signal": signal.Signals(-returncode).name}
    return {"exit_code": returncode}


def exit_text(returncode: int) -> str:
    return ", ".join(f"{key} {value}" for key, value in exit_facts(returncode).items())
