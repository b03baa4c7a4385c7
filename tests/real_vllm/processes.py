"""Starting and stopping the real vLLM (CPU build) the suite drives, in its configurations;
tether in front of it and the process plumbing come from `tests.support`."""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

from ..support.net import free_port
from ..support.processes import on_core, spawn
from ..support.real_engine.stacks import (
    MODEL_NAME,
    EngineServer,
    EngineStack,
    in_front_of,
    run_setup_script,
)
from ..support.real_engine.tether import start_tether

HERE = pathlib.Path(__file__).resolve().parent
VLLM_READY_TIMEOUT = 240.0


@dataclass(frozen=True)
class EngineInstall:
    """Where tests/engines/vllm_cpu.sh put vLLM's venv and the tiny model."""

    python: pathlib.Path
    model: pathlib.Path

    @property
    def vllm(self) -> pathlib.Path:
        return self.python.parent / "vllm"


def install_engine() -> EngineInstall:
    """Run the (idempotent, cached) setup script, tests/engines/vllm_cpu.sh."""
    values = run_setup_script("vllm_cpu.sh")
    return EngineInstall(pathlib.Path(values["VLLM_PYTHON"]), pathlib.Path(values["VLLM_MODEL"]))


@dataclass(frozen=True)
class RealtimeInstall:
    """What tests/engines/vllm_realtime.sh added for `/v1/realtime`: the tiny Qwen3-ASR
    realtime model, and the directory (torchvision) its vLLM needs on PYTHONPATH."""

    model: pathlib.Path
    pythonpath: pathlib.Path


def install_realtime() -> RealtimeInstall:
    """Run the (idempotent, cached) realtime setup script, tests/engines/vllm_realtime.sh."""
    values = run_setup_script("vllm_realtime.sh")
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


class VllmServer(EngineServer[VllmConfig]):
    """vLLM running in one configuration."""


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
    ready = process.wait_ready(f"http://127.0.0.1:{port}/health", VLLM_READY_TIMEOUT, "vLLM")
    return VllmServer(config, port, process, ready)


class Stack(EngineStack[VllmServer]):
    """A real vLLM with tether in front of it."""

    @property
    def vllm(self) -> VllmServer:
        return self.engine


def start_stack(name: str, install: EngineInstall, log_dir: pathlib.Path) -> Stack:
    """vLLM in configuration `name`, and tether in front of it."""
    vllm = start_vllm(CONFIGS[name], install, log_dir)
    return in_front_of(
        vllm, lambda engine: start_tether(engine.url, log_dir / f"tether-{name}.log"), Stack
    )
