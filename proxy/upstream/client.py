"""The connections to the engine: client requests go over tether's own HTTP/1.1 connections
(`pool`, `connection`, `exchange`; their heads are `wire.headers.EngineHeads`'), abort calls
and health checks over aiohttp sessions with connections of their own, so neither queues
behind the relay."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from .. import __version__
from ..engines import AbortCall
from ..engines.identify import MAX_PROBE_ANSWER
from ..settings import Settings
from .exchange import UpstreamExchange
from .pool import UploadLimit, UpstreamPool

# What tether's own requests to the engine (aborts, health checks, identity probes) carry
# as their User-Agent; clients' requests carry their own.
USER_AGENT = f"tether/{__version__}"


@dataclass(frozen=True, slots=True)
class ControlAnswer:
    """The engine's answer to a control call: its status, or (None) why there was none."""

    status: int | None
    failure: str = ""


class UpstreamClient:
    """Sends client requests, abort calls and health checks to the engine."""

    def __init__(
        self,
        settings: Settings,
        pool: UpstreamPool,
        control_session: aiohttp.ClientSession,
        fresh_session: aiohttp.ClientSession,
        health_session: aiohttp.ClientSession,
    ) -> None:
        self._pool = pool
        self._control_session = control_session
        self._fresh_session = fresh_session
        self._health_session = health_session
        self._abort_headers: dict[str, str] = {"Content-Type": "application/json"}
        if settings.upstream_admin_key is not None:
            key = settings.upstream_admin_key.get_secret_value()
            self._abort_headers["Authorization"] = f"Bearer {key}"
        self._base_url = settings.upstream_url
        # An engine that guards its reads with a key (SGLang and vLLM with --api-key) answers
        # what it is only to the key tether holds for it.
        self._probe_headers = {
            name: value for name, value in self._abort_headers.items() if name == "Authorization"
        }
        self._health_url = settings.upstream_url + settings.upstream_health_path
        self._health_timeout = aiohttp.ClientTimeout(total=max(settings.health_interval, 2.0))

    @classmethod
    @asynccontextmanager
    async def open(
        cls, settings: Settings, *, keepalive_seconds: float, uploads: UploadLimit
    ) -> AsyncIterator[UpstreamClient]:
        """The client and its connections; idle ones are closed after `keepalive_seconds`
        (the engine profile's: below the engine's own keep-alive, so tether never sends a
        request on a connection the engine is closing), and at most `uploads` held while
        their clients still send."""
        parts = urlsplit(settings.upstream_url)
        https = parts.scheme == "https"
        # tether's own calls say who makes them (the engine's logs, its access log).
        own = {"User-Agent": USER_AGENT}
        pool = UpstreamPool(
            parts.hostname or "",
            parts.port or (443 if https else 80),
            ssl_context=ssl.create_default_context() if https else None,
            connect_timeout=settings.connect_timeout,
            idle_timeout=keepalive_seconds,
            uploads=uploads,
        )
        # Abort calls keep a few connections of their own, warm, so an abort never waits for
        # a connection the relay is using nor pays for a new one at the worst moment.
        control_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=keepalive_seconds, ttl_dns_cache=60
            ),
            cookie_jar=aiohttp.DummyCookieJar(),
            headers=own,
        )
        # Repeated abort calls open a connection each: an engine front end with several
        # processes gets each on whichever process accepts it.
        fresh_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=0),
            cookie_jar=aiohttp.DummyCookieJar(),
            headers=own,
        )
        # Health checks open a fresh connection each time: they prove the engine still
        # accepts connections, and keep no pooled connection warm.
        health_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=1),
            cookie_jar=aiohttp.DummyCookieJar(),
            headers=own,
        )
        try:
            yield cls(settings, pool, control_session, fresh_session, health_session)
        finally:
            pool.close()
            await control_session.close()
            await fresh_session.close()
            await health_session.close()

    @property
    def idle_connections(self) -> int:
        """Pooled connections to the engine waiting for a request."""
        return self._pool.idle_connections

    def exchange(self, method: str, *, replayable: bool, upgrade: bool = False) -> UpstreamExchange:
        """A new exchange for one client request (`replayable`: it may be sent again on a new
        connection when a reused one closed unanswered; `upgrade`: a WebSocket handshake);
        `send` it with the head `wire.headers.EngineHeads` makes."""
        return UpstreamExchange(self._pool, method, replayable=replayable, upgrade=upgrade)

    async def send_abort(
        self, call: AbortCall, timeout: float, *, fresh: bool = False
    ) -> ControlAnswer:
        """Send one abort call (on a new connection when `fresh`): the engine's status, or
        why none came (a transport error or the timeout, folded into the answer)."""
        session = self._fresh_session if fresh else self._control_session
        try:
            async with session.request(
                call.method,
                call.url,
                data=call.body,
                headers=self._abort_headers if call.body is not None else None,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                await response.read()
                return ControlAnswer(response.status)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return ControlAnswer(None, exc.__class__.__name__)

    async def probe(self, path: str) -> Any:
        """The JSON document the engine answers a GET of `path` with (200, at most
        MAX_PROBE_ANSWER bytes), else None: what tells which engine it is
        (`engines.identify`)."""
        try:
            async with self._health_session.get(
                self._base_url + path,
                headers=self._probe_headers,
                timeout=self._health_timeout,
                allow_redirects=False,
            ) as response:
                if response.status != 200:
                    return None
                body = await response.content.read(MAX_PROBE_ANSWER + 1)
        except (TimeoutError, aiohttp.ClientError, OSError):
            return None
        if len(body) > MAX_PROBE_ANSWER:
            return None
        try:
            return json.loads(body)
        except ValueError:
            return None

    async def check_health(self) -> str | None:
        """None when the engine's health endpoint answers 2xx, else the reason it is not."""
        try:
            async with self._health_session.get(
                self._health_url, timeout=self._health_timeout, allow_redirects=False
            ) as response:
                await response.read()
                if 200 <= response.status < 300:
                    return None
                return f"engine health check answered {response.status}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return f"engine health check failed: {exc.__class__.__name__}: {exc}"
