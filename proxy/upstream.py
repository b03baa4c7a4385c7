"""The only module that talks to the engine: one pooled client session, requests, aborts and
health checks."""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
from multidict import CIMultiDict
from yarl import URL

from .engines import AbortCall
from .errors import UpstreamConnectTimeoutError, UpstreamUnavailableError
from .settings import Settings

Body = bytes | AsyncIterable[bytes] | None

# Idle pooled connections are closed after this long: below uvicorn's default keep-alive of
# 5 s (vLLM, SGLang), so tether never sends a request on a connection the engine is closing.
UPSTREAM_KEEPALIVE_SECONDS = 4.0


class UpstreamClient:
    """Sends client requests, abort calls and health checks to the engine."""

    def __init__(
        self,
        settings: Settings,
        session: aiohttp.ClientSession,
        health_session: aiohttp.ClientSession,
    ) -> None:
        self._base_url = settings.upstream_url
        self._session = session
        self._health_session = health_session
        self._request_timeout = aiohttp.ClientTimeout(
            total=None, connect=settings.connect_timeout, sock_connect=settings.connect_timeout
        )
        self._abort_headers: dict[str, str] = {"Content-Type": "application/json"}
        if settings.upstream_admin_key is not None:
            key = settings.upstream_admin_key.get_secret_value()
            self._abort_headers["Authorization"] = f"Bearer {key}"
        self._health_url = self._base_url + settings.upstream_health_path
        self._health_timeout = aiohttp.ClientTimeout(total=max(settings.health_interval, 2.0))

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: Settings) -> AsyncIterator[UpstreamClient]:
        connector = aiohttp.TCPConnector(
            limit=0,  # the engine's own admission control decides, not a pool size
            keepalive_timeout=UPSTREAM_KEEPALIVE_SECONDS,
            ttl_dns_cache=60,
            enable_cleanup_closed=True,
        )
        session = aiohttp.ClientSession(
            connector=connector,
            auto_decompress=False,  # compressed bodies pass through untouched
            # Only what the client sent goes upstream: no added User-Agent, Accept,
            # Accept-Encoding or Content-Type.
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
            cookie_jar=aiohttp.DummyCookieJar(),
            read_bufsize=2**16,
        )
        # Health checks open a fresh connection each time: they prove the engine still accepts
        # connections, and they do not keep the request pool's idle connections alive (the
        # pool hands out its oldest connection first, so frequent checks would touch them all).
        health_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True, limit=1),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        try:
            yield cls(settings, session, health_session)
        finally:
            await session.close()
            await health_session.close()

    async def send(
        self, method: str, path_qs: str, headers: CIMultiDict[str], body: Body
    ) -> aiohttp.ClientResponse:
        """Send a client's request; return once the engine's response headers arrived.

        If this is cancelled (the client left), aiohttp closes the connection rather than
        returning it to the pool, so the engine sees the disconnect too.
        """
        try:
            return await self._session.request(
                method,
                # As the client sent it: re-encoding could change what the engine routes on.
                URL(self._base_url + path_qs, encoded=True),
                headers=headers,
                data=body,
                allow_redirects=False,
                timeout=self._request_timeout,
                compress=None,
            )
        except aiohttp.ConnectionTimeoutError as exc:
            raise UpstreamConnectTimeoutError(
                f"the engine did not accept a connection within the connect timeout: {exc}"
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamUnavailableError(f"the engine is unreachable: {exc.os_error}") from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise UpstreamUnavailableError(
                f"the engine closed the connection before answering: {exc}"
            ) from exc

    async def send_abort(self, call: AbortCall, timeout: float) -> int:
        """Send one abort call; return the engine's status. Raises on transport errors."""
        async with self._session.request(
            call.method,
            call.url,
            data=call.body,
            headers=self._abort_headers if call.body is not None else None,
            allow_redirects=False,
            timeout=aiohttp.ClientTimeout(total=timeout),
        ) as response:
            await response.read()
            return response.status

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
