"""Starting and stopping the real SGLang (CPU) the suite drives, in its configurations; tether
in front of it and the process plumbing (spawn, readiness, core pinning) come from
`tests.support`, shared with the real-vLLM suite."""

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
from ..support.real_engine.tether import Tether
from ..support.real_engine.tether import start_tether as start_any_tether

SGLANG_READY_TIMEOUT = 240.0
# What clients send with `--api-key`; what SGLang's admin routes want with `--admin-api-key`.
API_KEY = "real-sglang-suite-api-key"
ADMIN_API_KEY = "real-sglang-suite-admin-key"


@dataclass(frozen=True)
class SglangInstall:
    """Where tests/engines/sglang_cpu.sh put SGLang's venv and the tiny model."""

    python: pathlib.Path
    model: pathlib.Path


def install_engine() -> SglangInstall:
    """Run the (idempotent, cached) setup script, tests/engines/sglang_cpu.sh."""
    values = run_setup_script("sglang_cpu.sh")
    return SglangInstall(
        pathlib.Path(values["SGLANG_PYTHON"]), pathlib.Path(values["SGLANG_MODEL"])
    )


@dataclass(frozen=True)
class SglangConfig:
    """One way of running SGLang; each is started once per session."""

    name: str
    max_running_requests: int = 16
    # Small chunks make a long prompt's prefill last seconds instead of ~50 ms, so a client
    # can leave during it.
    chunked_prefill_size: int | None = None
    api_key: str | None = None
    admin_api_key: str | None = None
    # `--tokenizer-worker-num`: HTTP front-end processes (uvicorn workers on one port), each
    # with a tokenizer manager of its own.
    tokenizer_workers: int = 1

    @property
    def abort_key(self) -> str | None:
        """The bearer token /abort_request needs (SGLang's ADMIN_OPTIONAL level): the admin
        key if there is one, else the API key, else none."""
        return self.admin_api_key or self.api_key

    def flags(self) -> list[str]:
        flags = ["--max-running-requests", str(self.max_running_requests)]
        if self.chunked_prefill_size is not None:
            flags += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.api_key is not None:
            flags += ["--api-key", self.api_key]
        if self.admin_api_key is not None:
            flags += ["--admin-api-key", self.admin_api_key]
        if self.tokenizer_workers > 1:
            flags += ["--tokenizer-worker-num", str(self.tokenizer_workers)]
        return flags


DEFAULT = SglangConfig("default")
# One running request at a time: the next one waits in SGLang's queue.
ONE_SLOT = SglangConfig("one-slot", max_running_requests=1, chunked_prefill_size=16)
ADMIN_KEY = SglangConfig("admin-key", admin_api_key=ADMIN_API_KEY)
WITH_API_KEY = SglangConfig("api-key", api_key=API_KEY)
TWO_TOKENIZER_WORKERS = SglangConfig("two-tokenizer-workers", tokenizer_workers=2)
CONFIGS = {
    config.name: config
    for config in (DEFAULT, ONE_SLOT, ADMIN_KEY, WITH_API_KEY, TWO_TOKENIZER_WORKERS)
}


class SglangServer(EngineServer[SglangConfig]):
    """SGLang running in one configuration."""

    @property
    def client_headers(self) -> dict[str, str]:
        """What a client must send on SGLang's normal routes (with `--api-key`)."""
        if self.config.api_key is None:
            return {}
        return {"Authorization": f"Bearer {self.config.api_key}"}


def start_sglang(
    config: SglangConfig, install: SglangInstall, log_dir: pathlib.Path
) -> SglangServer:
    port = free_port()
    env = {
        **os.environ,
        "SGLANG_USE_CPU_ENGINE": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    argv = [
        *on_core(1),
        str(install.python),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(install.model),
        "--served-model-name",
        MODEL_NAME,
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-overlap-schedule",
        # Without it the idle scheduler spins its core at 100 %.
        "--sleep-on-idle",
        "--dtype",
        "bfloat16",
        # The tiny model's max_position_embeddings.
        "--context-length",
        "2048",
        "--max-total-tokens",
        "32768",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # Debug level logs `Abort running request. req.rid='…'` and its queued/prefill kin.
        "--log-level",
        "debug",
        # `Receive:` / `Finish:` lines naming each request's rid (level 0: no prompt text).
        "--log-requests",
        "--log-requests-level",
        "0",
        "--enable-metrics",
        # `/v1/loads` (the suite's idle check) reads a snapshot the scheduler publishes every
        # N decode steps (default 15: ~0.1 s here, seconds on a starved core); every step.
        "--load-snapshot-publish-interval",
        "1",
        *config.flags(),
    ]
    process = spawn(argv, env, log_dir / f"sglang-{config.name}.log")
    ready = process.wait_ready(f"http://127.0.0.1:{port}/health", SGLANG_READY_TIMEOUT, "SGLang")
    return SglangServer(config, port, process, ready)


def start_tether(
    sglang: SglangServer, log_path: pathlib.Path, settings: dict[str, str] | None = None
) -> Tether:
    """tether (`TETHER_ENGINE=sglang`) in front of `sglang`, holding the key its abort calls
    need unless `settings` say otherwise."""
    key = sglang.config.abort_key
    defaults = {"TETHER_UPSTREAM_ADMIN_KEY": key} if key is not None else {}
    return start_any_tether(sglang.url, log_path, "sglang", {**defaults, **(settings or {})})


class Stack(EngineStack[SglangServer]):
    """A real SGLang with tether in front of it."""

    @property
    def sglang(self) -> SglangServer:
        return self.engine


def start_stack(name: str, install: SglangInstall, log_dir: pathlib.Path) -> Stack:
    """SGLang in configuration `name`, and tether in front of it."""
    sglang = start_sglang(CONFIGS[name], install, log_dir)
    return in_front_of(
        sglang, lambda engine: start_tether(engine, log_dir / f"tether-{name}.log"), Stack
    )
