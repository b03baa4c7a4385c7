"""Starting and stopping the real processes the suite drives: vLLM (CPU build) and tether."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import pytest

from ..support.net import free_port, free_ports
from ..support.smg import smg_command
from .measurements import Measurements
from .observe import LogFile, MetricsSnapshot, http_get, http_post_json, scrape, wait_until

REPO = pathlib.Path(__file__).resolve().parents[2]
SETUP_SCRIPT = REPO / "tests" / "engines" / "vllm_cpu.sh"
REALTIME_SETUP_SCRIPT = REPO / "tests" / "engines" / "vllm_realtime.sh"
HERE = pathlib.Path(__file__).resolve().parent
MODEL_NAME = "tiny"
VLLM_READY_TIMEOUT = 240.0
TETHER_READY_TIMEOUT = 30.0
ROUTER_READY_TIMEOUT = 30.0
ADMIN_TOKEN = "real-vllm-suite-token"


@dataclass(frozen=True)
class EngineInstall:
    """Where tests/engines/vllm_cpu.sh put vLLM's venv and the tiny model."""

    python: pathlib.Path
    model: pathlib.Path

    @property
    def vllm(self) -> pathlib.Path:
        return self.python.parent / "vllm"


def install_engine() -> EngineInstall:
    """Run the (idempotent, cached) setup script and read its last line."""
    result = subprocess.run(
        ["bash", str(SETUP_SCRIPT)], check=True, capture_output=True, text=True, timeout=1200
    )
    values = dict(item.split("=", 1) for item in result.stdout.strip().splitlines()[-1].split())
    return EngineInstall(pathlib.Path(values["VLLM_PYTHON"]), pathlib.Path(values["VLLM_MODEL"]))


@dataclass(frozen=True)
class RealtimeInstall:
    """What tests/engines/vllm_realtime.sh added for `/v1/realtime`: the tiny Qwen3-ASR
    realtime model, and the directory (torchvision) its vLLM needs on PYTHONPATH."""

    model: pathlib.Path
    pythonpath: pathlib.Path


def install_realtime() -> RealtimeInstall:
    """Run the (idempotent, cached) realtime setup script and read its last line."""
    result = subprocess.run(
        ["bash", str(REALTIME_SETUP_SCRIPT)],
        check=True,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    values = dict(item.split("=", 1) for item in result.stdout.strip().splitlines()[-1].split())
    return RealtimeInstall(
        pathlib.Path(values["VLLM_REALTIME_MODEL"]),
        pathlib.Path(values["VLLM_REALTIME_PYTHONPATH"]),
    )


@dataclass(frozen=True)
class VllmConfig:
    """One way of running vLLM; each is started once per session."""

    name: str
    dev_mode: bool = False
    middleware: str | None = None
    # VLLM_ENABLE_RESPONSES_API_STORE=1: the Responses API keeps responses in memory, for
    # `GET /v1/responses/{id}`, `previous_response_id`, `background: true` and `/cancel`.
    responses_store: bool = False
    # `--api-server-count`: API-server processes on the one port (vLLM's default for a
    # data-parallel pod is one per rank); each holds only the requests it received.
    api_servers: int = 1
    # Further `vllm serve` flags.
    flags: tuple[str, ...] = ()
    # Serve the tiny Qwen3-ASR realtime model (tests/engines/vllm_realtime.sh) instead of
    # the tiny Llama: vLLM then serves `/v1/realtime` (and no chat template).
    realtime: bool = False


DEFAULT = VllmConfig("default")
WITH_MIDDLEWARE = VllmConfig("default+middleware", middleware="user_middleware.tag_responses")
DEV_MODE = VllmConfig("dev-mode", dev_mode=True, responses_store=True)
# The abort route is what removes the middleware's late-detection tail (see README).
DEV_MODE_WITH_MIDDLEWARE = VllmConfig(
    "dev-mode+middleware", dev_mode=True, middleware="user_middleware.tag_responses"
)
DEV_MODE_TWO_API_SERVERS = VllmConfig("dev-mode+2-api-servers", dev_mode=True, api_servers=2)
# What test_transparency.py compares tether against: dev mode (the set-up tether documents),
# `X-Request-Id` echoed by vLLM itself, `tool_choice: "auto"`, which needs a tool-call parser
# (`pythonic` needs no special token, and the tiny model's tokenizer has none), and compact
# structured output (random weights otherwise fill a JSON answer with whitespace, so a forced
# tool call never completes). A configuration of its own: with a parser set, vLLM runs it over
# every chat answer, tools or not, which the other configurations' streams must not depend on.
TRANSPARENCY = VllmConfig(
    "transparency",
    dev_mode=True,
    flags=(
        "--enable-request-id-headers",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "pythonic",
        "--structured-outputs-config",
        '{"backend": "guidance", "disable_any_whitespace": true}',
    ),
)
# What test_realtime.py drives: vLLM's Realtime API (`/v1/realtime`, WebSocket), which vLLM
# registers only for a model with the realtime task; the default flags otherwise.
REALTIME = VllmConfig("realtime", realtime=True)
CONFIGS = {
    config.name: config
    for config in (
        DEFAULT,
        WITH_MIDDLEWARE,
        DEV_MODE,
        DEV_MODE_WITH_MIDDLEWARE,
        DEV_MODE_TWO_API_SERVERS,
        TRANSPARENCY,
        REALTIME,
    )
}


def on_core(core: int) -> list[str]:
    """`taskset -c <core>` when the machine has that core and taskset, else nothing."""
    if shutil.which("taskset") and (os.cpu_count() or 1) > core:
        return ["taskset", "-c", str(core)]
    return []


@dataclass
class Process:
    """A child process in its own session, logging to a file."""

    popen: subprocess.Popen[bytes]
    log: LogFile

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        if not self.alive():
            return
        os.killpg(self.popen.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)


def spawn(argv: list[str], env: dict[str, str], log_path: pathlib.Path) -> Process:
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


def wait_ready(process: Process, url: str, timeout: float, what: str) -> float:
    """Poll `url` until it answers 200; fail early, with the log's tail, if the process dies."""

    def ready() -> bool:
        if not process.alive():
            raise AssertionError(
                f"{what} exited ({process.popen.returncode}):\n{process.log.tail()}"
            )
        try:
            return http_get(url, timeout=2.0)[0] == 200
        except OSError:
            return False

    try:
        return wait_until(ready, timeout, f"{what} at {url}", interval=0.2)
    except AssertionError:
        process.stop()
        raise


@dataclass
class VllmServer:
    config: VllmConfig
    port: int
    process: Process
    ready_seconds: float

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> LogFile:
        return self.process.log


def start_vllm(config: VllmConfig, install: EngineInstall, log_dir: pathlib.Path) -> VllmServer:
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": str(HERE),
        # Every line of vLLM's own log starts with its epoch time in milliseconds (its
        # timestamp has whole seconds): `t=1796114396.452 (APIServer pid=…) INFO …`.
        "VLLM_LOGGING_PREFIX": "t=%(created).3f ",
    }
    model = install.model
    if config.realtime:
        realtime = install_realtime()
        model = realtime.model
        env["PYTHONPATH"] = os.pathsep.join((str(HERE), str(realtime.pythonpath)))
    for variable in ("VLLM_SERVER_DEV_MODE", "VLLM_ENABLE_RESPONSES_API_STORE"):
        env.pop(variable, None)
    if config.dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if config.responses_store:
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    argv = [
        *on_core(1),
        str(install.vllm),
        "serve",
        str(model),
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "16",
        "--enforce-eager",
        "--enable-log-requests",
    ]
    if config.middleware:
        argv += ["--middleware", config.middleware]
    if config.api_servers > 1:
        argv += ["--api-server-count", str(config.api_servers)]
    argv += config.flags
    process = spawn(argv, env, log_dir / f"vllm-{config.name}.log")
    ready = wait_ready(process, f"http://127.0.0.1:{port}/health", VLLM_READY_TIMEOUT, "vLLM")
    return VllmServer(config, port, process, ready)


@dataclass
class Tether:
    port: int
    admin_port: int
    process: Process
    ready_seconds: float
    token: str = ADMIN_TOKEN

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def log(self) -> LogFile:
        return self.process.log

    def metrics(self) -> MetricsSnapshot:
        return scrape(self.admin_url + "/metrics")

    def in_flight_requests(self) -> list[dict[str, Any]]:
        """`GET /admin/requests`: what tether is serving now."""
        status, body = http_get(
            self.admin_url + "/admin/requests", headers={"Authorization": f"Bearer {self.token}"}
        )
        assert status == 200, f"GET /admin/requests answered {status}: {body[:200]!r}"
        listing = json.loads(body)
        if isinstance(listing, dict):  # tolerate {"requests": [...]}
            listing = listing.get("requests", [])
        return list(listing)

    def wait_in_flight(self, client_request_id: str, timeout: float = 10.0) -> dict[str, Any]:
        """The in-flight entry for `client_request_id`, once tether lists it."""
        found: list[dict[str, Any]] = []

        def listed() -> bool:
            found[:] = [
                r
                for r in self.in_flight_requests()
                if r.get("client_request_id") == client_request_id
            ]
            return bool(found)

        wait_until(listed, timeout, f"{client_request_id} in tether's /admin/requests", 0.02)
        return found[0]

    def abort(self, client_request_id: str) -> tuple[int, bytes]:
        """`POST /admin/abort` with the admin token; (status, body)."""
        status, _, body = http_post_json(
            self.admin_url + "/admin/abort",
            {"request_id": client_request_id},
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        return status, body


def tether_executable() -> pathlib.Path:
    """The `tether` console script of the venv running pytest."""
    return pathlib.Path(sys.executable).parent / "tether"


def start_tether(
    upstream_url: str,
    log_path: pathlib.Path,
    engine: str = "vllm",
    settings: dict[str, str] | None = None,
) -> Tether:
    """The `tether` console script on core 0, once its /readyz says ready; `settings` are
    further TETHER_* variables."""
    port, admin_port = free_ports(2)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("TETHER_")},
        "TETHER_UPSTREAM_URL": upstream_url,
        "TETHER_HOST": "127.0.0.1",
        "TETHER_PORT": str(port),
        "TETHER_ADMIN_HOST": "127.0.0.1",
        "TETHER_ADMIN_PORT": str(admin_port),
        "TETHER_ENGINE": engine,
        "TETHER_ADMIN_TOKEN": ADMIN_TOKEN,
        "TETHER_LOG_FORMAT": "json",
        "TETHER_LOG_LEVEL": "debug",
        **(settings or {}),
    }
    process = spawn([*on_core(0), str(tether_executable())], env, log_path)
    ready = wait_ready(
        process, f"http://127.0.0.1:{admin_port}/readyz", TETHER_READY_TIMEOUT, "tether"
    )
    return Tether(port, admin_port, process, ready)


@dataclass
class Router:
    """smg (SGLang's model gateway) routing to one worker: tether, or an engine straight."""

    port: int
    worker_url: str
    process: Process

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@contextmanager
def router_in_front_of(worker_url: str, log_path: pathlib.Path, *extra: str) -> Iterator[Router]:
    """smg on core 0 routing to `worker_url` (further `smg launch` options in `extra`), once
    its `/readiness` says the worker is registered and healthy; stopped on exit."""
    port, metrics_port = free_ports(2)
    argv = [*on_core(0), *smg_command(worker_url, port, metrics_port, extra)]
    process = spawn(argv, dict(os.environ), log_path)
    try:
        wait_ready(process, f"http://127.0.0.1:{port}/readiness", ROUTER_READY_TIMEOUT, "smg")
        yield Router(port, worker_url, process)
    finally:
        process.stop()


class EngineStack(Protocol):
    """A real engine with tether in front of it, started for one configuration."""

    tether: Tether

    @property
    def name(self) -> str: ...

    @property
    def engine_ready_seconds(self) -> float: ...

    def stop(self) -> None: ...


StackT = TypeVar("StackT", bound=EngineStack)


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


@dataclass
class Stack:
    """A real vLLM with tether in front of it."""

    vllm: VllmServer
    tether: Tether

    @property
    def name(self) -> str:
        return self.vllm.config.name

    @property
    def engine_ready_seconds(self) -> float:
        return self.vllm.ready_seconds

    def stop(self) -> None:
        self.tether.process.stop()
        self.vllm.process.stop()


def start_stack(name: str, install: EngineInstall, log_dir: pathlib.Path) -> Stack:
    """vLLM in configuration `name`, and tether in front of it."""
    vllm = start_vllm(CONFIGS[name], install, log_dir)
    try:
        tether = start_tether(vllm.url, log_dir / f"tether-{name}.log")
    except BaseException:
        vllm.process.stop()
        raise
    return Stack(vllm, tether)
