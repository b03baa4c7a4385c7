"""A WebSocket engine on the stack vLLM runs its Realtime API on (uvicorn 0.54 with
`websockets`, FastAPI), speaking the Realtime event shape, served in the test's own event loop.

`/v1/realtime` accepts (with the first subprotocol the client offers, and whatever
permessage-deflate the two agree), sends `session.created`, then answers each text event:
`input_audio_buffer.append` is acknowledged, `input_audio_buffer.commit` starts a
transcription that sends a `transcription.delta` every few milliseconds until the session
ends (the engine's bad habit: like vLLM, it stops only once `receive` fails, that is when it
sees a close frame or its socket close), `echo` comes back as it was, `close` makes the
engine close with the code asked for. Binary frames come back as they were. Each session's
record says what it saw and when (`time.monotonic()`) and how it ended.

uvicorn notices a silent client only at its WebSocket ping timeout (`ws_ping_interval` and
`ws_ping_timeout`, 20 s each by default, as vLLM runs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, WebSocket, WebSocketDisconnect

DELTA_INTERVAL = 0.005


@dataclass
class Session:
    subprotocol: str | None
    request_id: str | None  # the X-Request-Id the engine got
    headers: dict[str, str]
    received: list[str | bytes] = field(default_factory=list)
    deltas_sent: int = 0
    ended_at: float | None = None
    close_code: int | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class RealtimeEngine:
    def __init__(self) -> None:
        self.sessions: list[Session] = []
        self._changed = asyncio.Condition()
        self.app = FastAPI()
        self.app.add_api_websocket_route("/v1/realtime", self._realtime)
        self.app.add_api_route("/health", self._health)
        self.url = ""

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 5.0) -> None:
        """Until `predicate()` holds (checked at each session start, delta and end)."""
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(predicate)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _health(self) -> dict[str, str]:
        return {"status": "ok"}

    async def _realtime(self, websocket: WebSocket) -> None:
        offered = websocket.scope.get("subprotocols") or []
        subprotocol = offered[0] if offered else None
        session = Session(
            subprotocol,
            websocket.headers.get("x-request-id"),
            {name: value for name, value in websocket.headers.items()},
        )
        self.sessions.append(session)
        await self._notify()
        await websocket.accept(subprotocol=subprotocol)
        await websocket.send_text(json.dumps({"type": "session.created", "session": {}}))
        transcribing: asyncio.Task[None] | None = None
        try:
            while True:
                message = await websocket.receive()
                if message["type"] == "websocket.disconnect":
                    session.close_code = message.get("code")
                    break
                if message.get("bytes") is not None:
                    session.received.append(message["bytes"])
                    await websocket.send_bytes(message["bytes"])
                    continue
                text = message["text"]
                session.received.append(text)
                event = json.loads(text)
                kind = event.get("type")
                if kind == "input_audio_buffer.append":
                    await websocket.send_text(json.dumps({"type": "input_audio_buffer.ack"}))
                elif kind == "input_audio_buffer.commit" and transcribing is None:
                    transcribing = asyncio.create_task(self._transcribe(websocket, session))
                elif kind == "echo":
                    await websocket.send_text(text)
                elif kind == "close":
                    await websocket.close(code=int(event["code"]), reason=event.get("reason", ""))
                    session.close_code = int(event["code"])
                    break
        except WebSocketDisconnect as disconnect:
            session.close_code = disconnect.code
        finally:
            session.ended_at = time.monotonic()
            session.ended.set()
            await self._notify()
            if transcribing is not None:
                transcribing.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await transcribing

    async def _transcribe(self, websocket: WebSocket, session: Session) -> None:
        while True:
            await websocket.send_text(
                json.dumps({"type": "transcription.delta", "delta": f"w{session.deltas_sent}"})
            )
            session.deltas_sent += 1
            await self._notify()
            await asyncio.sleep(DELTA_INTERVAL)  # the engine's pace


@contextlib.asynccontextmanager
async def realtime_engine(**uvicorn_options: Any) -> AsyncIterator[RealtimeEngine]:
    """The engine on a free loopback port, in this event loop."""
    engine = RealtimeEngine()
    config = uvicorn.Config(
        engine.app,
        host="127.0.0.1",
        port=0,
        ws="websockets-sansio",  # what uvicorn 0.54 picks with websockets installed (vLLM)
        lifespan="off",
        log_level="warning",
        **uvicorn_options,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if serving.done():
                    serving.result()
                await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        engine.url = f"http://127.0.0.1:{port}"
        yield engine
    finally:
        server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            async with asyncio.timeout(10):
                await serving
