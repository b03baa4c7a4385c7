"""The supervisor's calls to one worker's admin app, over the worker's private Unix socket.

Every call is bounded; a worker that does not answer, or answers what its admin app never
would, raises `WorkerAdminError` naming the worker, so the supervisor reports that worker's
problem instead of an answer that silently leaves it out.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
from pydantic import SecretStr

# A worker answers from its own event loop; one busy relaying still answers within this.
_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
# A resumed stream lasts as long as the engine's answer.
_STREAM_TIMEOUT = aiohttp.ClientTimeout(total=None)


class WorkerAdminError(Exception):
    """A worker's admin app could not be asked, or answered nonsense."""

    def __init__(self, index: int, detail: str) -> None:
        super().__init__(f"worker {index}: {detail}")
        self.index = index
        self.detail = detail


class WorkerAdmin:
    """One worker's admin app."""

    def __init__(self, index: int, session: aiohttp.ClientSession) -> None:
        self.index = index
        self._session = session

    @classmethod
    @asynccontextmanager
    async def open(cls, index: int, socket_path: str) -> AsyncIterator[WorkerAdmin]:
        session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=socket_path),
            timeout=_TIMEOUT,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        try:
            yield cls(index, session)
        finally:
            await session.close()

    async def answers(self) -> bool:
        """Whether its admin app answers at all (the worker finished starting)."""
        try:
            async with self._session.get("http://worker/healthz") as response:
                return response.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    async def readiness_problem(self) -> str | None:
        """None when the worker is ready, else its reason."""
        status, payload = await self._call("GET", "/readyz")
        if status == 200:
            return None
        reason = payload.get("reason") if isinstance(payload, dict) else None
        return str(reason) if reason else f"not ready ({status})"

    async def metrics(self) -> str:
        """Its Prometheus exposition."""
        try:
            async with self._session.get("http://worker/metrics") as response:
                text = await response.text()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise WorkerAdminError(self.index, _failure(exc)) from exc
        if response.status != 200:
            raise WorkerAdminError(self.index, f"/metrics answered {response.status}")
        return text

    async def in_flight(self, token: SecretStr) -> list[dict[str, Any]]:
        """Its in-flight list, as its `/admin/requests` gives it."""
        status, payload = await self._call("GET", "/admin/requests", token=token)
        requests = payload.get("requests") if isinstance(payload, dict) else None
        if status != 200 or not isinstance(requests, list):
            raise WorkerAdminError(self.index, f"/admin/requests answered {status}")
        return requests

    async def abort(self, request_id: str, token: SecretStr) -> list[str]:
        """Abort `request_id` on this worker; the internal IDs it stopped."""
        body = {"request_id": request_id, "scope": "local"}
        status, payload = await self._call("POST", "/admin/abort", token=token, body=body)
        aborted = payload.get("aborted") if isinstance(payload, dict) else None
        if status != 200 or not isinstance(aborted, list):
            raise WorkerAdminError(self.index, f"/admin/abort answered {status}")
        return [str(item) for item in aborted]

    async def cancel(
        self, request_id: str, caller: str | None, token: SecretStr
    ) -> dict[str, object]:
        """Cancel the caller's (`caller`: its hash, hex) requests with this ID held by this
        worker; its answer."""
        body = {"request_id": request_id, "caller": caller}
        status, payload = await self._call("POST", "/admin/cancel", token=token, body=body)
        if status != 200 or not isinstance(payload, dict):
            raise WorkerAdminError(self.index, f"/admin/cancel answered {status}")
        return payload

    async def resume(
        self, request_id: str, caller: str | None, last_received: int, token: SecretStr
    ) -> aiohttp.ClientResponse | None:
        """Resume the caller's (`caller`: its hash, hex) stream with this ID held by this
        worker: its answer, open (200: the events to relay; else its refusal), or None when
        the worker does not hold it. Only the head is bounded: the stream lasts as long as
        the answer."""
        body = {"request_id": request_id, "caller": caller, "last_received": last_received}
        try:
            async with asyncio.timeout(_TIMEOUT.total):
                response = await self._session.post(
                    "http://worker/admin/resume",
                    headers={"Authorization": f"Bearer {token.get_secret_value()}"},
                    json=body,
                    timeout=_STREAM_TIMEOUT,
                )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise WorkerAdminError(self.index, f"/admin/resume: {_failure(exc)}") from exc
        if response.status == 404:
            response.release()
            return None
        return response

    async def _call(
        self,
        method: str,
        path: str,
        *,
        token: SecretStr | None = None,
        body: Mapping[str, str | None] | None = None,
    ) -> tuple[int, object]:
        headers = {}
        if token is not None:
            headers["Authorization"] = f"Bearer {token.get_secret_value()}"
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body)
        try:
            async with self._session.request(
                method, f"http://worker{path}", headers=headers, data=data
            ) as response:
                return response.status, await response.json(content_type=None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
            raise WorkerAdminError(self.index, f"{path}: {_failure(exc)}") from exc


def _failure(exc: BaseException) -> str:
    detail = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
    return f"admin socket not answering ({detail})"
