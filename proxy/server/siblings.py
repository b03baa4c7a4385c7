"""A worker's calls to the supervisor's other workers (TETHER_WORKERS > 1) for cancel by ID,
`GET /v1/requests` and resume: each asked directly over its private admin socket, with no
admin token.

The client port spreads a caller's connections over the workers, so a cancel, a list or a
resume that lands on one worker must reach the requests another holds, whatever the operator
configured (no admin token, TETHER_ADMIN_PORT=0). Why this is safe without a token:

- the sockets live in the supervisor's runtime directory (`workers.runtime`), made mode 0700
  and owned by this user, and a worker refuses to start when its directory is not so
  (`private_directory_problem`): only processes of this user (and root) reach them, and those
  can already read the workers' memory and environment (the caller key, any admin token), so
  the socket lets them do nothing they could not;
- the sibling routes are served on that Unix socket only, never on a TCP port, and nothing
  new listens on the network;
- a sibling answers for the caller hash asked and nothing else: a cancel stops, a list
  shows and a resume relays only that caller's requests (the hash is keyed with the key all
  workers share, so it is the same caller wherever its request landed), and never an
  internal ID.

Why worker to worker rather than through the supervisor: the sockets are already there, and
each worker is handed the others' paths, so the supervisor needs no socket, no server and no
second fan-out of its own. A worker that is restarting does not answer, and holds nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import aiohttp
import structlog

from ..settings import Settings
from .fleet import PeerCancellation

log = structlog.get_logger("tether.cancel")

CANCEL_PATH = "/siblings/cancel"
REQUESTS_PATH = "/siblings/requests"
RESUME_PATH = "/siblings/resume"
# A sibling's cancel answers once its engine's stop is known: the stream's event end, the
# request letting go, then the confirm timeout (`cancel.CancelRoutes._stopped`); this margin
# covers the rest on a loaded machine.
_CANCEL_MARGIN_SECONDS = 5.0
# A list is answered from memory at once.
_LIST_TIMEOUT = aiohttp.ClientTimeout(total=5.0)
# A resumed stream lasts as long as the answer: only its head is bounded (a held stream's
# head is written at once).
_RESUME_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=None)
_RESUME_HEAD_SECONDS = 5.0


def private_directory_problem(path: str) -> str | None:
    """Why `path` is not private to this user (None when it is): the sibling routes are
    authorised by their socket's directory alone."""
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != os.getuid():
        return f"{path} is owned by another user"
    if info.st_mode & 0o077:
        return f"{path} is reachable by other users (mode {stat.S_IMODE(info.st_mode):o})"
    return None


class Siblings:
    """The other workers of this worker's supervisor (none for one process)."""

    def __init__(self, sessions: list[aiohttp.ClientSession], settings: Settings) -> None:
        self._sessions = sessions
        self._cancel_timeout = aiohttp.ClientTimeout(
            total=2 * settings.abort_confirm_timeout + _CANCEL_MARGIN_SECONDS
        )

    @classmethod
    @asynccontextmanager
    async def open(cls, settings: Settings, sockets: tuple[str, ...]) -> AsyncIterator[Siblings]:
        async with AsyncExitStack() as stack:
            sessions = [
                await stack.enter_async_context(
                    aiohttp.ClientSession(
                        connector=aiohttp.UnixConnector(path=path),
                        cookie_jar=aiohttp.DummyCookieJar(),
                    )
                )
                for path in sockets
            ]
            yield cls(sessions, settings)

    def __bool__(self) -> bool:
        return bool(self._sessions)

    async def cancel(
        self, request_ids: list[str], caller: bytes | None
    ) -> list[PeerCancellation | None]:
        """Ask every sibling, in one call each, to cancel the caller's requests with these IDs;
        for each ID the answer of the sibling that held it (a request is on one worker), or
        None."""
        body = {"request_ids": request_ids, "caller": _hex(caller)}
        answers = await asyncio.gather(
            *(self._ask(s, CANCEL_PATH, body, self._cancel_timeout) for s in self._sessions)
        )
        found: list[PeerCancellation | None] = [None] * len(request_ids)
        for answer in answers:
            data = answer.get("data") if answer is not None else None
            if not isinstance(data, list) or len(data) != len(request_ids):
                continue
            for at, each in enumerate(data):
                cancelled = each.get("cancelled") if isinstance(each, dict) else None
                if found[at] is None and isinstance(cancelled, int) and cancelled > 0:
                    engine = each.get("engine")
                    found[at] = PeerCancellation(
                        replica=str(each.get("replica")),
                        cancelled=cancelled,
                        engine=engine if isinstance(engine, str) else None,
                    )
        return found

    async def requests(self, caller: bytes | None) -> list[dict[str, Any]]:
        """The caller's requests in flight on every sibling, as `GET /v1/requests` lists them
        (each sibling lists at most `cancel.MAX_LISTED`)."""
        body = {"caller": _hex(caller)}
        answers = await asyncio.gather(
            *(self._ask(s, REQUESTS_PATH, body, _LIST_TIMEOUT) for s in self._sessions)
        )
        listed: list[dict[str, Any]] = []
        for answer in answers:
            data = answer.get("data") if answer is not None else None
            if isinstance(data, list):
                listed.extend(entry for entry in data if isinstance(entry, dict))
        return listed

    async def resume(
        self, request_id: str, caller: bytes | None, last_received: int
    ) -> aiohttp.ClientResponse | None:
        """The caller's held stream with this ID, resumed on the sibling that holds it: that
        sibling's answer, open (200: the events to relay; else its refusal, such as events no
        longer held), or None when no sibling holds it (they answer 404)."""
        body = json.dumps(
            {"request_id": request_id, "caller": _hex(caller), "last_received": last_received}
        )
        answers = await asyncio.gather(*(self._resume_on(s, body) for s in self._sessions))
        found = [answer for answer in answers if answer is not None]
        for extra in found[1:]:  # (a stream is held by one worker: never more than one)
            extra.close()
        return found[0] if found else None

    async def _resume_on(
        self, session: aiohttp.ClientSession, body: str
    ) -> aiohttp.ClientResponse | None:
        try:
            async with asyncio.timeout(_RESUME_HEAD_SECONDS):
                response = await session.post(
                    f"http://worker{RESUME_PATH}", data=body, timeout=_RESUME_TIMEOUT
                )
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            log.warning("sibling_not_answering", route=RESUME_PATH, error=exc.__class__.__name__)
            return None
        if response.status == 404:
            response.release()
            return None
        return response

    async def _ask(
        self,
        session: aiohttp.ClientSession,
        path: str,
        body: Mapping[str, object],
        timeout: aiohttp.ClientTimeout,
    ) -> dict[str, Any] | None:
        try:
            async with session.post(
                f"http://worker{path}", data=json.dumps(body), timeout=timeout
            ) as response:
                payload = await response.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
            # Restarting (its socket gone for a moment) or stuck: it holds nothing we can reach.
            log.warning("sibling_not_answering", route=path, error=exc.__class__.__name__)
            return None
        if response.status != 200 or not isinstance(payload, dict):
            return None
        return payload


def _hex(caller: bytes | None) -> str | None:
    return caller.hex() if caller is not None else None
