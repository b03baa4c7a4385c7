"""The processes under test: the fake engine, and the ways a client can reach it.

Each system is a listening address plus the pid whose process tree is "the proxy" (none
for a direct connection): direct, nginx, smg (SGLang's Rust model gateway, the closest
peer), tether, and variants of tether: at log level info (`tether_info`), with tracing on
(`tether_otel`), without asking for usage (`tether_nousage`), on its pure-Python data plane
(`tether_pure`: TETHER_NO_EXTENSIONS=1, where `tether` runs the compiled one). `nginx_2w`
and `tether_2w` run two workers (`worker_processes 2`, TETHER_WORKERS=2) on both cores,
which they share with the engine and the load generator: what a second core buys on this
machine, nginx's ratio being the reference for what the machine allows. `aiohttp_floor` is
the least proxy tether's stack makes (`bench/floor_proxy.py`): what is left above it is
tether's own. Processes are pinned
with sched_setaffinity before exec (smg's threads with it, the workers with their parent).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

PROXY_CORE = 0
CLIENT_CORE = 1  # engine, load generator and this runner
PROXY_CORES = frozenset({PROXY_CORE})
CLIENT_CORES = frozenset({CLIENT_CORE})
BOTH_CORES = frozenset({PROXY_CORE, CLIENT_CORE})  # the two-worker systems
STARTUP_TIMEOUT_S = 30.0
REPO_ROOT = Path(__file__).resolve().parents[1]  # where `python -m bench.<module>` resolves
# Every system the bench knows, in the order of the table's columns.
SYSTEMS = (
    "direct",
    "nginx",
    "smg",
    "tether",
    "tether_info",
    "tether_otel",
    "tether_nousage",
    "tether_pure",
    "nginx_2w",
    "tether_2w",
    "aiohttp_floor",
)

NGINX_CONF = """\
worker_processes {workers};
worker_rlimit_nofile {nofile};
pid {tmp}/{name}.pid;
error_log {tmp}/{name}-error.log warn;
events {{
    worker_connections {nofile};
}}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    keepalive_requests 1000000;
    upstream engine {{
        server 127.0.0.1:{engine_port};
        keepalive 1024;
        keepalive_requests 1000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_cache off;
            proxy_read_timeout 3600s;
        }}
    }}
}}
"""


@dataclass(frozen=True, slots=True)
class Engine:
    """The fake engine's port (also the direct system's) and pid."""

    port: int
    pid: int


@dataclass(frozen=True, slots=True)
class System:
    """Where the load generator connects, and whose CPU and memory count as the proxy's."""

    name: str
    port: int
    proxy_pid: int | None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pinned(cores: frozenset[int]) -> Callable[[], None]:
    """A preexec_fn that pins the child (and what it starts) to these cores."""
    return lambda: os.sched_setaffinity(0, cores)


def wait_http_ok(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready after {STARTUP_TIMEOUT_S}s")


@contextmanager
def running(
    args: list[str],
    *,
    cores: frozenset[int],
    log: Path,
    env: dict[str, str] | None = None,
    cwd: Path = REPO_ROOT,
) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as log_file:
        process = subprocess.Popen(
            args,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=cwd,
            preexec_fn=pinned(cores),
        )
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@contextmanager
def engine(tmp: Path) -> Iterator[Engine]:
    port = free_port()
    args = [sys.executable, "-m", "bench.engine", "--port", str(port)]
    with running(args, cores=CLIENT_CORES, log=tmp / "engine.log") as process:
        wait_http_ok(f"http://127.0.0.1:{port}/health", process)
        yield Engine(port, process.pid)


def nginx_binary() -> str:
    """Debian installs nginx in /usr/sbin, which a non-root PATH may lack."""
    return shutil.which("nginx") or "/usr/sbin/nginx"


@contextmanager
def nginx(
    tmp: Path, engine_port: int, nofile: int, *, name: str = "nginx", workers: int = 1
) -> Iterator[System]:
    """nginx with `workers` worker processes, on the proxy's core (both cores with more than
    one worker)."""
    port = free_port()
    conf = tmp / f"{name}.conf"
    conf.write_text(
        NGINX_CONF.format(
            tmp=tmp, name=name, engine_port=engine_port, port=port, nofile=nofile, workers=workers
        )
    )
    args = [nginx_binary(), "-c", str(conf), "-g", "daemon off;"]
    cores = PROXY_CORES if workers == 1 else BOTH_CORES
    with running(args, cores=cores, log=tmp / f"{name}.log") as process:
        wait_http_ok(f"http://127.0.0.1:{port}/health", process)
        yield System(name, port, process.pid)


def console_script(name: str) -> str | None:
    """The command `name` beside this interpreter (a venv that is not on PATH), else on PATH."""
    beside = Path(sys.executable).with_name(name)
    return str(beside) if beside.exists() else shutil.which(name)


def smg_launch(executable: str, worker_url: str, port: int, metrics_port: int) -> list[str]:
    """`smg launch` as a plain router in front of one worker, as its docs run it: round
    robin, on loopback, its Prometheus listener on `metrics_port`, stopping at once (its
    default grace, 180 s, waits 5 s even when idle). The tests start it this way too."""
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
        "--shutdown-grace-period-secs",
        "0",
    ]


@contextmanager
def smg(tmp: Path, engine_port: int) -> Iterator[System]:
    """smg in front of the one engine; its `/readiness` answers 200 once it has registered
    the engine (from `/v1/models`) and found it healthy."""
    executable = console_script("smg")
    if executable is None:
        raise FileNotFoundError("no `smg` command: pip install -e '.[test]' installs it")
    port, metrics_port = free_port(), free_port()
    args = smg_launch(executable, f"http://127.0.0.1:{engine_port}", port, metrics_port)
    with running(args, cores=PROXY_CORES, log=tmp / "smg.log") as process:
        wait_http_ok(f"http://127.0.0.1:{port}/readiness", process)
        yield System("smg", port, process.pid)


def tether_binary() -> str:
    """`tether` from the active venv (next to this interpreter), else from PATH."""
    found = console_script("tether")
    if found is None:
        raise FileNotFoundError("no `tether` command: install the package into the active venv")
    return found


@contextmanager
def tether(
    tmp: Path,
    engine_port: int,
    *,
    name: str,
    log_level: str,
    traced: bool = False,
    ask_for_usage: bool = True,
    pure: bool = False,
    workers: int = 1,
) -> Iterator[System]:
    """tether in front of the engine; `traced` exports its spans to the engine's OTLP sink;
    without `ask_for_usage` it leaves request bodies and streams as they are; `pure` runs its
    pure-Python modules even where the compiled ones are installed; more than one of
    `workers` runs them under a supervisor, on both cores."""
    port, admin_port = free_port(), free_port()
    # No OTEL_* from the caller's environment: under the default TETHER_TRACING=auto an
    # exporter endpoint would turn tracing on, and a sampler would change what it costs.
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env |= {
        "TETHER_UPSTREAM_URL": f"http://127.0.0.1:{engine_port}",
        "TETHER_HOST": "127.0.0.1",
        "TETHER_PORT": str(port),
        "TETHER_ADMIN_PORT": str(admin_port),
        "TETHER_ENGINE": "vllm",
        "TETHER_LOG_LEVEL": log_level,
        "TETHER_LOG_FORMAT": "json",
        "TETHER_TRACING": "off",
        "TETHER_ASK_FOR_USAGE": "true" if ask_for_usage else "false",
        "TETHER_WORKERS": str(workers),
        # Not a setting: which code runs the data plane (`proxy.compiled`).
        "TETHER_NO_EXTENSIONS": "1" if pure else "",
    }
    if traced:
        # OTLP/HTTP to the fake engine's /v1/traces; the batch processor's settings are the
        # SDK's defaults (a batch every 5 s or per 512 spans), as a deployment would have them.
        env |= {
            "TETHER_TRACING": "on",
            "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{engine_port}",
        }
    # The temp dir as working directory keeps a stray .env in the checkout out of tether.
    cores = PROXY_CORES if workers == 1 else BOTH_CORES
    with running(
        [tether_binary()], cores=cores, log=tmp / f"{name}.log", env=env, cwd=tmp
    ) as process:
        wait_http_ok(f"http://127.0.0.1:{admin_port}/readyz", process)
        yield System(name, port, process.pid)


def tether_extensions(pure: bool = False) -> str:
    """Which data plane the `tether` command runs (`proxy.compiled.extensions()`), asked of
    its own interpreter outside the checkout."""
    interpreter = Path(tether_binary()).read_text().splitlines()[0].removeprefix("#!").strip()
    env = os.environ | {"TETHER_NO_EXTENSIONS": "1" if pure else ""}
    answer = subprocess.run(
        [interpreter, "-c", "import proxy.compiled as c; print(c.extensions())"],
        capture_output=True,
        text=True,
        check=False,
        cwd="/",
        env=env,
    )
    return answer.stdout.strip() or f"unknown ({answer.stderr.strip()[-200:]})"


@contextmanager
def aiohttp_floor(tmp: Path, engine_port: int) -> Iterator[System]:
    """`bench/floor_proxy.py` on the proxy's core: the floor under tether's figures."""
    port = free_port()
    args = [sys.executable, "-m", "bench.floor_proxy", "--port", str(port)]
    args += ["--engine-port", str(engine_port)]
    with running(args, cores=PROXY_CORES, log=tmp / "aiohttp_floor.log") as process:
        wait_http_ok(f"http://127.0.0.1:{port}/health", process)
        yield System("aiohttp_floor", port, process.pid)


@contextmanager
def all_systems(
    tmp: Path, names: list[str], nofile: int
) -> Iterator[tuple[Engine, dict[str, System]]]:
    """Start the engine and the named systems; yields the engine and the systems by name."""
    with ExitStack() as stack:
        fake_engine = stack.enter_context(engine(tmp))
        engine_port = fake_engine.port
        systems: dict[str, System] = {}
        for name in names:
            if name == "direct":
                systems[name] = System(name, engine_port, None)
            elif name == "nginx":
                systems[name] = stack.enter_context(nginx(tmp, engine_port, nofile))
            elif name == "smg":
                systems[name] = stack.enter_context(smg(tmp, engine_port))
            elif name == "tether":
                systems[name] = stack.enter_context(
                    tether(tmp, engine_port, name=name, log_level="warning")
                )
            elif name == "tether_info":
                systems[name] = stack.enter_context(
                    tether(tmp, engine_port, name=name, log_level="info")
                )
            elif name == "tether_otel":
                systems[name] = stack.enter_context(
                    tether(tmp, engine_port, name=name, log_level="warning", traced=True)
                )
            elif name == "tether_nousage":
                systems[name] = stack.enter_context(
                    tether(tmp, engine_port, name=name, log_level="warning", ask_for_usage=False)
                )
            elif name == "tether_pure":
                systems[name] = stack.enter_context(
                    tether(tmp, engine_port, name=name, log_level="warning", pure=True)
                )
            elif name == "nginx_2w":
                systems[name] = stack.enter_context(
                    nginx(tmp, engine_port, nofile, name=name, workers=2)
                )
            elif name == "tether_2w":
                systems[name] = stack.enter_context(
                    tether(tmp, engine_port, name=name, log_level="warning", workers=2)
                )
            elif name == "aiohttp_floor":
                systems[name] = stack.enter_context(aiohttp_floor(tmp, engine_port))
            else:
                raise ValueError(f"unknown system {name!r}")
        yield fake_engine, systems
