"""Instructions per non-streaming request: tether against the floor, counted, not timed.

`python -m bench.instructions [--requests N] [--systems tether,aiohttp_floor]` runs each
proxy under valgrind's callgrind in front of the bench's fake engine (run natively), sends it
warm-up requests, zeroes the counters, sends N more one after another on one keep-alive
connection, and dumps the counters: the instructions the proxy's process executed per
request, CPython, aiohttp, uvloop and the kernel's entry included (the kernel itself is not
counted). A count does not move with what else the machine runs, which the bench's CPU
seconds do: it is the figure for a change's cost on a busy machine, and the bench's table
(`python -m bench --workloads requests`) says what those instructions cost in time on a
quiet one.

Slow by design (callgrind runs the proxy about 50 times slower): a minute or two per system.
Needs valgrind (Debian: `apt-get install valgrind`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .systems import CLIENT_CORES, PROXY_CORES, free_port, running

SYSTEMS = ("tether", "aiohttp_floor")
# Under callgrind a start-up (imports, the frozen heap) takes a minute or more.
_START_TIMEOUT_S = 300.0
_WARMUP_REQUESTS = 200


def _request(port: int, n: int) -> bytes:
    body = json.dumps(
        {"model": "bench", "messages": [{"role": "user", "content": "hi"}], "stream": False},
        separators=(",", ":"),
    ).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"x-request-id: client-{n}\r\n\r\n"
    ).encode() + body


def _send(port: int, first: int, count: int) -> None:
    """`count` requests one after another on one keep-alive connection, each answered whole
    (with a Content-Length) before the next goes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        pending = b""
        for n in range(first, first + count):
            sock.sendall(_request(port, n))
            while True:
                head_end = pending.find(b"\r\n\r\n")
                if head_end >= 0:
                    head = pending[:head_end].decode("latin-1")
                    match = re.search(r"(?im)^content-length:\s*(\d+)", head)
                    if match is None:
                        raise RuntimeError(f"an answer without a length: {head!r}")
                    if not head.startswith("HTTP/1.1 200"):
                        raise RuntimeError(f"not a 200: {head.splitlines()[0]!r}")
                    end = head_end + 4 + int(match.group(1))
                    if len(pending) >= end:
                        pending = pending[end:]
                        break
                chunk = sock.recv(65536)
                if not chunk:
                    raise RuntimeError("the proxy closed the connection")
                pending += chunk


def _wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"exited with {process.returncode} before listening")
        try:
            _send(port, 0, 1)
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"not answering on port {port} after {_START_TIMEOUT_S:.0f} s")


def _proxy_command(
    system: str, port: int, engine_port: int, tmp: Path
) -> tuple[list[str], dict[str, str]]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    if system == "tether":
        env |= {
            "TETHER_UPSTREAM_URL": f"http://127.0.0.1:{engine_port}",
            "TETHER_HOST": "127.0.0.1",
            "TETHER_PORT": str(port),
            "TETHER_ADMIN_PORT": str(free_port()),
            "TETHER_ENGINE": "vllm",
            "TETHER_LOG_LEVEL": "warning",
            "TETHER_LOG_FORMAT": "json",
            "TETHER_TRACING": "off",
        }
        return [sys.executable, "-m", "proxy"], env
    if system == "aiohttp_floor":
        args = ["-m", "bench.floor_proxy", "--port", str(port), "--engine-port", str(engine_port)]
        return [sys.executable, *args], env
    raise ValueError(f"unknown system {system!r}")


def count(system: str, requests: int, tmp: Path) -> float:
    """Instructions per request of `system`, over `requests` requests after the warm-up."""
    engine_port, port = free_port(), free_port()
    out = tmp / f"{system}.callgrind"
    engine_args = [sys.executable, "-m", "bench.engine", "--port", str(engine_port)]
    with running(engine_args, cores=CLIENT_CORES, log=tmp / "engine.log", env=dict(os.environ)):
        args, env = _proxy_command(system, port, engine_port, tmp)
        valgrind = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            "--dump-instr=no",
            "--compress-strings=no",
        ]
        with running(
            [*valgrind, *args], cores=PROXY_CORES, log=tmp / f"{system}.log", env=env
        ) as process:
            _wait_listening(port, process)
            _send(port, 1, _WARMUP_REQUESTS)
            subprocess.run(
                ["callgrind_control", "--zero", str(process.pid)], check=True, capture_output=True
            )
            _send(port, 10_000, requests)
            subprocess.run(
                ["callgrind_control", "--dump", str(process.pid)], check=True, capture_output=True
            )
    dumps = sorted(tmp.glob(f"{system}.callgrind.*"), key=lambda path: path.stat().st_mtime)
    if not dumps:
        raise RuntimeError(f"callgrind wrote no dump for {system}")
    totals = re.search(r"(?m)^(?:totals|summary):\s*(\d+)", dumps[0].read_text())
    if totals is None:
        raise RuntimeError(f"no totals in {dumps[0]}")
    return int(totals.group(1)) / requests


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    options = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (Debian: apt-get install valgrind)")
    figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="tether-instructions-") as tmp:
        for system in options.systems.split(","):
            figures[system] = count(system, options.requests, Path(tmp))
            print(f"{system:>14}: {figures[system]:>12,.0f} instructions per request")
    if {"tether", "aiohttp_floor"} <= figures.keys():
        above = figures["tether"] - figures["aiohttp_floor"]
        print(f"tether above the floor: {above:,.0f} instructions per request")


if __name__ == "__main__":
    main()
