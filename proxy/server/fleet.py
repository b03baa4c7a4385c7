"""Abort, cancel and resume by request ID across every replica: a caller knows its own request
ID, not which pod holds it. The peers are the addresses of a headless Service (every A/AAAA
record of TETHER_FLEET_DNS) or a static TETHER_FLEET_PEERS list; each gets the same admin call,
with the same token, concurrently and with a short timeout. An unreachable peer is listed,
never fatal.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import aiohttp

from ..settings import Settings, split_host_port


@dataclass(frozen=True, slots=True)
class PeerResult:
    """What one replica answered to a fleet abort."""

    peer: str
    status: str  # "ok", "unreachable" or "error"
    replica: str | None = None
    aborted: tuple[str, ...] = ()
    detail: str | None = None

    def as_json(self) -> dict[str, object]:
        result: dict[str, object] = {"peer": self.peer, "status": self.status}
        if self.replica is not None:
            result["replica"] = self.replica
        result["aborted"] = list(self.aborted)
        if self.detail is not None:
            result["detail"] = self.detail
        return result


@dataclass(frozen=True, slots=True)
class PeerCancellation:
    """What the replica that held a request answered to a cancel by ID."""

    replica: str
    cancelled: int
    engine: str | None


class Fleet:
    """The other replicas' admin APIs, as far as this one knows them."""

    def __init__(self, settings: Settings, session: aiohttp.ClientSession) -> None:
        self._dns = (
            split_host_port(settings.fleet_dns, settings.admin_port)
            if settings.fleet_dns is not None
            else None
        )
        self._static = tuple(
            split_host_port(peer, settings.admin_port) for peer in settings.fleet_peers
        )
        self._timeout = aiohttp.ClientTimeout(total=settings.fleet_timeout)
        # A peer's cancel answers once its engine's stop is known (bounded by its confirm
        # timeout) on top of the call itself.
        self._cancel_timeout = aiohttp.ClientTimeout(
            total=settings.fleet_timeout + settings.abort_confirm_timeout + 1.0
        )
        # A resumed stream lasts as long as the answer: only connecting is bounded.
        self._stream_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=settings.fleet_timeout, sock_read=None
        )
        self._token = settings.admin_token
        self._session = session
        # This replica, told apart from the others in a fan-out (a DNS answer lists it too):
        # a random instance ID, and the host name operators know it by (the pod's name).
        self.instance_id = os.urandom(8).hex()
        self.replica = settings.replica_name or socket.gethostname()

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: Settings) -> AsyncIterator[Fleet]:
        # Peer calls use connections of their own: never the engine's, never warm for long.
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        try:
            yield cls(settings, session)
        finally:
            await session.close()

    @property
    def configured(self) -> bool:
        return self._dns is not None or bool(self._static)

    async def peers(self) -> list[tuple[str, int]]:
        """Every replica address: all records of the DNS name, then the static list."""
        found: list[tuple[str, int]] = []
        if self._dns is not None:
            host, port = self._dns
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )
            except socket.gaierror:
                infos = []
            found.extend((str(info[4][0]), port) for info in infos)
        found.extend(self._static)
        return list(dict.fromkeys(found))  # in order, once each

    async def abort(self, request_id: str) -> list[PeerResult]:
        """Ask every peer to abort `request_id` locally; this replica's own answer (a DNS name
        lists it too) is left out."""
        peers = await self.peers()
        results = await asyncio.gather(
            *(self._abort_on(host, port, request_id) for host, port in peers)
        )
        return [result for result in results if result is not None]

    async def cancel(self, request_id: str, caller: bytes | None) -> PeerCancellation | None:
        """Ask every peer to cancel the caller's requests with this ID; the answer of the
        first (normally the only) one that held any, or None. The caller goes as its keyed
        hash (the same on every replica: the key derives from the admin token)."""
        peers = await self.peers()
        body = json.dumps(
            {"request_id": request_id, "caller": caller.hex() if caller is not None else None}
        )
        answers = await asyncio.gather(*(self._cancel_on(host, port, body) for host, port in peers))
        held = [answer for answer in answers if answer is not None and answer.cancelled]
        return held[0] if held else None

    async def resume(
        self, request_id: str, caller: bytes | None, last_received: int
    ) -> aiohttp.ClientResponse | None:
        """The caller's held stream with this ID, resumed on the peer that holds it: that
        peer's answer, open (200: the events to relay; else its refusal), or None when no peer
        holds it. (Only one can: the rest answer 404, or cannot answer.)"""
        peers = await self.peers()
        body = json.dumps(
            {
                "request_id": request_id,
                "caller": caller.hex() if caller is not None else None,
                "last_received": last_received,
            }
        )
        answers = await asyncio.gather(*(self._resume_on(host, port, body) for host, port in peers))
        found = [answer for answer in answers if answer is not None]
        for extra in found[1:]:
            extra.close()
        return found[0] if found else None

    async def _resume_on(self, host: str, port: int, body: str) -> aiohttp.ClientResponse | None:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            response = await self._session.post(
                f"http://{address}/admin/resume",
                data=body,
                headers=self._headers(),
                timeout=self._stream_timeout,
            )
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None  # a replica that cannot answer holds nothing we can resume
        if response.status in (401, 403, 404):
            response.release()
            return None
        return response

    async def _cancel_on(self, host: str, port: int, body: str) -> PeerCancellation | None:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            async with self._session.post(
                f"http://{address}/admin/cancel",
                data=body,
                headers=self._headers(),
                timeout=self._cancel_timeout,
            ) as response:
                payload = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError):
            return None  # a replica that cannot answer holds nothing we can cancel
        if response.status != 200 or not isinstance(payload, dict):
            return None
        if payload.get("instance") == self.instance_id:
            return None
        cancelled = payload.get("cancelled")
        engine = payload.get("engine")
        return PeerCancellation(
            replica=str(payload.get("replica")),
            cancelled=cancelled if isinstance(cancelled, int) else 0,
            engine=engine if isinstance(engine, str) else None,
        )

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self._token is not None:
            headers["Authorization"] = f"Bearer {self._token.get_secret_value()}"
        return headers

    async def _abort_on(self, host: str, port: int, request_id: str) -> PeerResult | None:
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        headers = self._headers()
        body = json.dumps({"request_id": request_id, "scope": "local"})
        try:
            async with self._session.post(
                f"http://{address}/admin/abort", data=body, headers=headers, timeout=self._timeout
            ) as response:
                payload = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            return PeerResult(address, "unreachable", detail=exc.__class__.__name__)
        if not isinstance(payload, dict):
            return PeerResult(address, "error", detail=f"answered {response.status}")
        if payload.get("instance") == self.instance_id:
            return None
        if response.status != 200:
            error = payload.get("error")
            message = error.get("message") if isinstance(error, dict) else None
            return PeerResult(address, "error", detail=f"{response.status}: {message}")
        aborted = payload.get("aborted")
        return PeerResult(
            address,
            "ok",
            replica=str(payload.get("replica")),
            aborted=tuple(str(item) for item in aborted) if isinstance(aborted, list) else (),
        )
