"""nginx in front of an engine, configured as a careful operator runs it before an inference
server (upstream keep-alive, no buffering either way): the reference a test compares tether
with, in the same test, wherever nginx is installed (CI installs it; `.ci/run`)."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from .net import free_port

_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 1024; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/client_body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    upstream engine {{
        server 127.0.0.1:{engine_port};
        keepalive 16;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
            proxy_read_timeout {read_timeout_ms}ms;
        }}
    }}
}}
"""


def nginx_binary() -> str | None:
    """Debian installs nginx in /usr/sbin, which a non-root PATH may lack."""
    found = shutil.which("nginx")
    if found is not None:
        return found
    return "/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None


@asynccontextmanager
async def nginx_in_front_of(engine_port: int, *, read_timeout: float = 60.0) -> AsyncIterator[int]:
    """nginx proxying to the engine (or tether) on loopback; yields the port clients connect
    to. `read_timeout`: its `proxy_read_timeout`, the longest silence between two reads of
    the upstream's response before nginx cuts it (an idle-cutting load balancer)."""
    binary = nginx_binary()
    assert binary is not None, "nginx is not installed"
    with tempfile.TemporaryDirectory(prefix="tether-nginx-") as tmp:
        port = free_port()
        conf = Path(tmp) / "nginx.conf"
        conf.write_text(
            _CONF.format(
                tmp=tmp,
                engine_port=engine_port,
                port=port,
                read_timeout_ms=round(read_timeout * 1000),
            )
        )
        process = await asyncio.create_subprocess_exec(
            binary,
            "-c",
            str(conf),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await _wait_listening(port, process)
            yield port
        finally:
            if process.returncode is None:
                process.terminate()
                await asyncio.wait_for(process.wait(), 10)


async def _wait_listening(port: int, process: asyncio.subprocess.Process) -> None:
    async with asyncio.timeout(10):
        while True:
            if process.returncode is not None:
                raise RuntimeError(f"nginx exited with {process.returncode}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
            except OSError:
                await asyncio.sleep(0.02)
                continue
            writer.close()
            return
