"""The `tether` console script in front of a real engine, and its admin API as the real-engine
suites call it (blocking)."""

from __future__ import annotations

import json
import pathlib
import sys
from dataclasses import dataclass
from typing import Any

from ..blocking_http import http_get, http_post_json
from ..metrics import MetricsSnapshot, scrape
from ..net import free_ports
from ..processes import LogFile, Process, on_core, spawn, tether_environment
from ..waiting import wait_until

TETHER_READY_TIMEOUT = 30.0
ADMIN_TOKEN = "real-vllm-suite-token"


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

    def relayed(self, route: str) -> float:
        """Requests tether relayed on `route` that the engine answered 2xx (tether's own
        readiness checks are not counted there)."""
        return self.metrics().value("tether_requests_total", route=route, status_class="2xx")

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
    env = tether_environment(
        **{
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
    )
    process = spawn([*on_core(0), str(tether_executable())], env, log_path)
    ready = process.wait_ready(
        f"http://127.0.0.1:{admin_port}/readyz", TETHER_READY_TIMEOUT, "tether"
    )
    return Tether(port, admin_port, process, ready)
