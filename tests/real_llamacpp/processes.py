"""Starting and stopping the real llama-server the suite drives, in its configurations; tether
in front of it (`TETHER_ENGINE=llamacpp`, as config/llamacpp.env runs it) and the process
plumbing (spawn, readiness, core pinning) come from `tests.support`, shared with the other
real-engine suites."""

from __future__ import annotations

import functools
import os
import pathlib
import subprocess
from dataclasses import dataclass

from ..support.net import free_port
from ..support.processes import on_core, spawn
from ..support.real_engine.stacks import (
    ENGINE_SCRIPTS,
    MODEL_NAME,
    EngineServer,
    EngineStack,
    in_front_of,
    run_setup_script,
)
from ..support.real_engine.tether import Tether
from ..support.real_engine.tether import start_tether as start_any_tether
from .server_log import ServerLog

LLAMACPP_READY_TIMEOUT = 60.0
# Tokens of context each slot gets: a 3,000-token prompt and the longest answer a test
# asks for (12,000 tokens) fit.
SLOT_CONTEXT = 16384
# HTTP threads: more than the suite ever holds open at once (two occupants, the measured
# client, tether's health checks), so that no request waits unseen in the accept queue
# (the default is max(np + 2, cores - 1)).
HTTP_THREADS = 8
# The logical batch: a prompt is processed 2,048 tokens per step, and a cancel takes effect
# only once the step in progress ends (the default, set so that the phase is measurable).
BATCH = 2048


@dataclass(frozen=True)
class LlamacppInstall:
    """Where tests/engines/llamacpp.sh put llama-server, and the tiny model
    tests/engines/tiny_gguf.py wrote for this run."""

    server: pathlib.Path
    model: pathlib.Path


def install_engine() -> LlamacppInstall:
    """Run the (idempotent, cached) setup script, then write the tiny GGUF (about a second)
    with the venv's python."""
    values = run_setup_script("llamacpp.sh")
    python = pathlib.Path(values["LLAMACPP_PYTHON"])
    # Beside the venv (its directory), written afresh and renamed into place: a run that
    # already serves the file keeps reading the one it opened.
    model = python.parents[1] / "tether-tiny.gguf"
    partial = model.with_suffix(f".{os.getpid()}.partial")
    subprocess.run(
        [str(python), str(ENGINE_SCRIPTS / "tiny_gguf.py"), str(partial)],
        check=True,
        capture_output=True,
        timeout=120,
    )
    partial.replace(model)
    return LlamacppInstall(pathlib.Path(values["LLAMACPP_SERVER"]), model)


@dataclass(frozen=True)
class LlamacppConfig:
    """One way of running llama-server; each is started once per session."""

    name: str
    # `-np`: slots, requests generating at once; the next one waits in the task queue.
    parallel: int

    def flags(self) -> list[str]:
        return [
            "-np",
            str(self.parallel),
            "-c",
            str(SLOT_CONTEXT * self.parallel),
            "-b",
            str(BATCH),
            "--threads-http",
            str(HTTP_THREADS),
        ]


# Two slots: a client's request beside another client's stream; queued behind two streams.
TWO_SLOTS = LlamacppConfig("two-slots", parallel=2)
# One slot: a second request waits in the queue behind the first.
ONE_SLOT = LlamacppConfig("one-slot", parallel=1)
CONFIGS = {config.name: config for config in (TWO_SLOTS, ONE_SLOT)}


class LlamacppServer(EngineServer[LlamacppConfig]):
    """llama-server running in one configuration."""

    @functools.cached_property
    def events(self) -> ServerLog:
        """Its log, read as slot and task events with llama-server's own timestamps (one
        reader per server: it keeps the clock offset it measured)."""
        return ServerLog(self.log, self.url)


def start_llamacpp(
    config: LlamacppConfig, install: LlamacppInstall, log_dir: pathlib.Path
) -> LlamacppServer:
    port = free_port()
    argv = [
        *on_core(1),
        str(install.server),
        "-m",
        str(install.model),
        "--alias",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        # One thread for generation and prompts: the core it is pinned to.
        "-t",
        "1",
        "-tb",
        "1",
        # No host-memory prompt cache: a prompt is processed in full every time (the suite
        # sends fresh prompts too, so a slot's own cache never shortens a prefill).
        "--cache-ram",
        "0",
        # Every line with its time since start and its level: the suite's evidence.
        "--log-timestamps",
        "--log-prefix",
        *config.flags(),
    ]
    # llama-server reads LLAMA_ARG_* variables as flags: none of this environment's.
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
    process = spawn(argv, env, log_dir / f"llamacpp-{config.name}.log")
    ready = process.wait_ready(
        f"http://127.0.0.1:{port}/health", LLAMACPP_READY_TIMEOUT, "llama-server"
    )
    return LlamacppServer(config, port, process, ready)


def start_tether(llamacpp: LlamacppServer, log_path: pathlib.Path) -> Tether:
    """tether in front of `llamacpp` as config/llamacpp.env runs it:
    `TETHER_ENGINE=llamacpp` (close the connection, or stop a conversation stream with its
    DELETE), readiness from `/health`."""
    return start_any_tether(
        llamacpp.url, log_path, "llamacpp", {"TETHER_UPSTREAM_HEALTH_PATH": "/health"}
    )


class Stack(EngineStack[LlamacppServer]):
    """A real llama-server with tether in front of it."""

    @property
    def llamacpp(self) -> LlamacppServer:
        return self.engine


def start_stack(name: str, install: LlamacppInstall, log_dir: pathlib.Path) -> Stack:
    """llama-server in configuration `name`, and tether in front of it."""
    llamacpp = start_llamacpp(CONFIGS[name], install, log_dir)
    return in_front_of(
        llamacpp, lambda engine: start_tether(engine, log_dir / f"tether-{name}.log"), Stack
    )
