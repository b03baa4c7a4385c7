"""A fake OpenAI-compatible engine that behaves like vLLM, bad habits included.

For the demo (`tether-fake-engine`), the container smoke test and the test suite. Like a real
engine it keys each request by the ID it is given (`X-Request-Id`, or SGLang's body `rid`) and
echoes it as `"id": "chatcmpl-<id>"`. Like the engines tether exists for, it **keeps
generating after its client disconnects** unless an abort call names the request (or it is
started with `--hears-disconnects`). It records every request, generation and abort call so
tests can assert on what the engine saw.

Per-request knobs ride in the JSON body, which real engines would ignore:
`"fake": {"token_interval": s, "prefill": s, "fail_after": n, "stall_after": n}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from aiohttp import web
from multidict import CIMultiDict


class AbortRoute(StrEnum):
    """Which abort API the fake engine offers, mirroring vLLM 0.32's modes and SGLang."""

    DEV = "dev"  # VLLM_SERVER_DEV_MODE=1: POST /abort_requests
    SCALE_OUT = "scale-out"  # --enable-scale-out: POST /inference/v1/abort_requests
    NONE = "none"  # default `vllm serve`: 404 / 403
    SGLANG = "sglang"  # POST /abort_request {"rid": ...}, prefix match


class GenerationState(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    ABORTED = "aborted"


@dataclass
class Generation:
    """One request being generated, independent of the HTTP exchange that asked for it."""

    request_id: str
    engine_id: str  # what aborts must name: chatcmpl-<id> / cmpl-<id> / the rid
    max_tokens: int
    token_interval: float
    prefill: float
    stall_after: int | None
    started_at: float = field(default_factory=time.monotonic)
    ended_at: float | None = None
    state: GenerationState = GenerationState.RUNNING
    tokens: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    produced: int = 0
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    def end(self, state: GenerationState) -> None:
        if self.state is GenerationState.RUNNING:
            self.state = state
            self.ended_at = time.monotonic()
            self.tokens.put_nowait(None)
            self.ended.set()


@dataclass(frozen=True)
class SeenRequest:
    method: str
    path: str
    headers: CIMultiDict[str]
    body: bytes
    at: float


@dataclass(frozen=True)
class SeenAbort:
    path: str
    ids: tuple[str, ...]
    status: int
    at: float


class FakeEngine:
    def __init__(
        self,
        *,
        abort_route: AbortRoute = AbortRoute.DEV,
        token_interval: float = 0.01,
        max_tokens: int = 16,
        hears_disconnects: bool = False,
    ) -> None:
        self.abort_route = abort_route
        self.token_interval = token_interval
        self.max_tokens = max_tokens
        self.hears_disconnects = hears_disconnects
        self.healthy = True
        self.abort_failures = 0  # answer this many abort calls with 503 first
        self.abort_hangs = False
        self.print_aborts = False  # the CLI prints each abort call it honours
        self.requests: list[SeenRequest] = []
        self.generations: dict[str, Generation] = {}
        self.aborts: list[SeenAbort] = []
        self.disconnects: list[tuple[str, float]] = []
        self._changed = asyncio.Condition()
        self.app = self._make_app()

    # --- what tests wait on ---------------------------------------------------------------

    async def wait_for(self, predicate: Any, timeout: float = 5.0) -> None:
        """Until `predicate()` holds (re-checked whenever the engine records something)."""
        async with asyncio.timeout(timeout):
            async with self._changed:
                await self._changed.wait_for(predicate)

    def generation(self, request_id: str) -> Generation:
        return self.generations[request_id]

    def aborted_ids(self) -> set[str]:
        return {
            g.request_id for g in self.generations.values() if g.state is GenerationState.ABORTED
        }

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- HTTP ---------------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._completions)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/generate", self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/abort_requests", self._abort_vllm)
        app.router.add_post("/inference/v1/abort_requests", self._abort_vllm)
        app.router.add_post("/abort_request", self._abort_sglang)
        app.router.add_route("*", "/echo/{tail:.*}", self._echo)
        app.on_shutdown.append(self._stop_generations)
        return app

    async def _stop_generations(self, _app: web.Application) -> None:
        for generation in self.generations.values():
            if generation.task is not None:
                generation.task.cancel()

    async def _health(self, request: web.Request) -> web.Response:
        if self.healthy:
            return web.Response(status=200)
        return web.json_response({"error": "unhealthy"}, status=503)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def _echo(self, request: web.Request) -> web.Response:
        """Answers with what it received, for header and body pass-through tests."""
        body = await request.read()
        self.requests.append(
            SeenRequest(
                request.method,
                request.path_qs,
                CIMultiDict(request.headers),
                body,
                time.monotonic(),
            )
        )
        await self._notify()
        return web.json_response(
            {
                "method": request.method,
                "path": request.raw_path,
                "headers": dict(request.headers),
                "body": body.decode("utf-8", "replace"),
            }
        )

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.requests.append(
            SeenRequest(
                request.method, request.path, CIMultiDict(request.headers), body, time.monotonic()
            )
        )
        payload: dict[str, Any] = json.loads(body) if body else {}
        knobs = payload.get("fake", {})
        if self.abort_route is AbortRoute.SGLANG:
            request_id = payload.get("rid") or os.urandom(8).hex()
            engine_id = request_id
        else:
            request_id = (
                request.headers.get("X-Request-Id")
                or payload.get("request_id")
                or os.urandom(8).hex()
            )
            prefix = "chatcmpl-" if request.path.endswith("chat/completions") else "cmpl-"
            engine_id = prefix + request_id
        generation = Generation(
            request_id=request_id,
            engine_id=engine_id,
            max_tokens=int(payload.get("max_tokens", self.max_tokens)),
            token_interval=float(knobs.get("token_interval", self.token_interval)),
            prefill=float(knobs.get("prefill", 0.0)),
            stall_after=knobs.get("stall_after"),
        )
        self.generations[request_id] = generation
        generation.task = asyncio.get_running_loop().create_task(self._generate(generation))
        await self._notify()
        try:
            if payload.get("stream"):
                return await self._stream(request, generation, knobs)
            return await self._whole(generation)
        except (asyncio.CancelledError, ConnectionError):
            self.disconnects.append((request_id, time.monotonic()))
            if self.hears_disconnects:
                generation.end(GenerationState.ABORTED)
            await self._notify()
            raise

    async def _generate(self, generation: Generation) -> None:
        """Produce tokens until done or aborted; the HTTP side only reads them."""
        try:
            await asyncio.sleep(generation.prefill)
            for index in range(generation.max_tokens):
                if generation.state is not GenerationState.RUNNING:
                    return
                if generation.stall_after is not None and index >= generation.stall_after:
                    await asyncio.Event().wait()  # stuck engine: never another token
                generation.tokens.put_nowait(f" tok{index}")
                generation.produced += 1
                await self._notify()
                await asyncio.sleep(generation.token_interval)
            generation.end(GenerationState.COMPLETED)
        finally:
            await self._notify()

    async def _stream(
        self, request: web.Request, generation: Generation, knobs: dict[str, Any]
    ) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        fail_after = knobs.get("fail_after")
        sent = 0
        async for chunk in self._chunks(generation):
            if fail_after is not None and sent >= fail_after:
                assert request.transport is not None
                request.transport.abort()  # crash mid-stream
                return response
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            sent += 1
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _chunks(self, generation: Generation) -> AsyncIterator[dict[str, Any]]:
        yield self._chunk(generation, {"role": "assistant", "content": ""}, None)
        while (token := await generation.tokens.get()) is not None:
            yield self._chunk(generation, {"content": token}, None)
        reason = "abort" if generation.state is GenerationState.ABORTED else "length"
        yield self._chunk(generation, {"content": ""}, reason)

    @staticmethod
    def _chunk(generation: Generation, delta: dict[str, str], reason: str | None) -> dict[str, Any]:
        return {
            "id": generation.engine_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": "fake",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
        }

    async def _whole(self, generation: Generation) -> web.Response:
        await generation.ended.wait()
        text = []
        while not generation.tokens.empty():
            token = generation.tokens.get_nowait()
            if token is not None:
                text.append(token)
        reason = "abort" if generation.state is GenerationState.ABORTED else "length"
        return web.json_response(
            {
                "id": generation.engine_id,
                "object": "chat.completion",
                "model": "fake",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "".join(text)},
                        "finish_reason": reason,
                    }
                ],
                "usage": {"completion_tokens": generation.produced},
            }
        )

    async def _abort_vllm(self, request: web.Request) -> web.Response:
        route_on = {
            "/abort_requests": self.abort_route is AbortRoute.DEV,
            "/inference/v1/abort_requests": self.abort_route is AbortRoute.SCALE_OUT,
        }[request.path]
        if not route_on:
            status = 403 if request.path.startswith("/inference") else 404
            self.aborts.append(SeenAbort(request.path, (), status, time.monotonic()))
            await self._notify()
            return web.json_response({"detail": "Not Found"}, status=status)
        payload = await request.json()
        ids = tuple(payload.get("request_ids") or ())
        failure = await self._injected_failure(request.path, ids)
        if failure is not None:
            return failure
        # Like vLLM's dev route: an empty list aborts every running request.
        targets = [g for g in self.generations.values() if not ids or g.engine_id in ids]
        return await self._abort(
            request.path, ids, targets, {"status": "aborted", "aborted": len(ids)}
        )

    async def _abort_sglang(self, request: web.Request) -> web.Response:
        if self.abort_route is not AbortRoute.SGLANG:
            return web.json_response({"detail": "Not Found"}, status=404)
        payload = await request.json()
        rid = str(payload.get("rid") or "")
        failure = await self._injected_failure(request.path, (rid,))
        if failure is not None:
            return failure
        # SGLang matches by prefix, so unique fixed-length rids matter.
        targets = [g for g in self.generations.values() if g.engine_id.startswith(rid)]
        return await self._abort(request.path, (rid,), targets, None)

    async def _injected_failure(self, path: str, ids: tuple[str, ...]) -> web.Response | None:
        if self.abort_hangs:
            self.aborts.append(SeenAbort(path, ids, 0, time.monotonic()))
            await self._notify()
            await asyncio.Event().wait()
        if self.abort_failures > 0:
            self.abort_failures -= 1
            self.aborts.append(SeenAbort(path, ids, 503, time.monotonic()))
            await self._notify()
            return web.json_response({"error": "busy"}, status=503)
        return None

    async def _abort(
        self, path: str, ids: tuple[str, ...], targets: list[Generation], reply: object
    ) -> web.Response:
        self.aborts.append(SeenAbort(path, ids, 200, time.monotonic()))
        if self.print_aborts:
            print(
                json.dumps(
                    {
                        "event": "abort_received",
                        "path": path,
                        "ids": ids,
                        "aborted": [g.request_id for g in targets],
                    }
                ),
                flush=True,
            )
        for generation in targets:
            generation.end(GenerationState.ABORTED)
        await self._notify()
        return web.json_response(reply) if reply is not None else web.Response(status=200)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--abort-route", type=AbortRoute, default=AbortRoute.DEV, choices=list(AbortRoute)
    )
    parser.add_argument("--token-interval", type=float, default=0.05, help="seconds between tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--hears-disconnects",
        action="store_true",
        help="stop generating when the client disconnects (vLLM 0.32 does)",
    )
    args = parser.parse_args()
    engine = FakeEngine(
        abort_route=args.abort_route,
        token_interval=args.token_interval,
        max_tokens=args.max_tokens,
        hears_disconnects=args.hears_disconnects,
    )
    engine.print_aborts = True
    web.run_app(
        engine.app,
        host=args.host,
        port=args.port,
        handler_cancellation=True,
        print=lambda _: print(
            f"fake engine on http://{args.host}:{args.port} (abort route: {args.abort_route})",
            flush=True,
        ),
    )


if __name__ == "__main__":
    main()
