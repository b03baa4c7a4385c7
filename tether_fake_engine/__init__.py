"""A fake OpenAI-compatible engine that behaves like vLLM (or SGLang), bad habits included.

For the demo (`tether-fake-engine`), the container smoke test and the test suite. Like the
real engines it keys each request by the ID its route takes, read from tether's own route
tables (`proxy.engines.vllm` and `.sglang`, verified on vLLM 0.32 and SGLang 0.5.23):
`chatcmpl-<X-Request-Id>` for chat and Anthropic messages, `cmpl-<X-Request-Id>-<i>` per
completion prompt, the body's `request_id` plus `_0` for the Responses API (which ignores
the header), the body's `rid` verbatim for SGLang; it answers in their wire format
(compact JSON, the role event first, `finish_reason` on the last token, `"abort"` on an extra
event after an abort, usage where asked for). Like the engines tether exists for, it **keeps
generating after its client disconnects** unless an abort call names the request (or it is
started with `--hears-disconnects`), and an aborted stream then ends as vLLM's does. With
`front_end_processes` above 1 it behaves like vLLM with several API-server processes on one
port: each connection belongs to one process (whichever accepted it: seeded random), and
an abort call acts only on requests that arrived at the process its own connection did. It
records every request, token, abort call and disconnect so tests can assert on what the
engine saw and when.

With `abort_route="llamacpp"` it plays llama.cpp's server instead (see `AbortRoute`).

Per-request knobs ride in the JSON body, which real engines would ignore:
`"fake": {"token_interval": s, "prefill": s, "fail_after": n, "stall_after": n,
"head_after": s, "answer_status": n}`: `prefill` is the time from the request's arrival to
its first token (the generation starts at once: with `head_after` as long, the stream's head
comes with no silence after it), `head_after` the silence before its head (a queue, a proxy
that buffers), and `answer_status` answers that status with vLLM's error body (after
`head_after`) instead of generating.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import string
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.engines import REQUEST_ID_HEADER, BodyField, Route, llamacpp, sglang, vllm
from proxy.wire.json_members import JsonObject

_Handler = Callable[[web.Request], Awaitable[web.Response]]


class AbortRoute(StrEnum):
    """Which abort API the fake engine offers, mirroring vLLM 0.32's modes and SGLang."""

    DEV = "dev"  # VLLM_SERVER_DEV_MODE=1: POST /abort_requests
    SCALE_OUT = "scale-out"  # --enable-scale-out: POST /inference/v1/abort_requests
    NONE = "none"  # default `vllm serve`: 404 / 403
    SGLANG = "sglang"  # POST /abort_request {"rid": ...}: a rid it holds, then by prefix
    # llama.cpp's server: no abort call but DELETE /v1/stream?conv_id= for a conversation
    # stream (X-Conversation-Id), which runs on after its client leaves; it ignores every
    # ID it is given and answers `chatcmpl-<32 random alphanumerics>`, with `timings`
    # (`predicted_n`) on a stream's last event and in every answer.
    LLAMACPP = "llamacpp"


class GenerationState(StrEnum):
    RUNNING = "running"
    COMPLETED = "completed"
    ABORTED = "aborted"


class Api(StrEnum):
    """The response format of a route."""

    CHAT = "chat"
    COMPLETION = "completion"
    MESSAGES = "messages"
    RESPONSES = "responses"
    GENERATE = "generate"  # SGLang's native /generate


_ROUTES = {
    "/v1/chat/completions": Api.CHAT,
    "/v1/completions": Api.COMPLETION,
    "/v1/messages": Api.MESSAGES,
    "/v1/responses": Api.RESPONSES,
    "/generate": Api.GENERATE,
}
# Which engine ID each route makes of the ID a request is keyed by, and which `id` it answers
# with: the route tables tether itself relies on.
_VLLM_ROUTES = {route.path: route for route in vllm.ROUTES}
_SGLANG_ROUTES = {route.path: route for route in sglang.ROUTES}
_DEV_ABORT, _SCALE_OUT_ABORT = vllm.ABORT_PATHS


@dataclass
class Generation:
    """One request being generated, independent of the HTTP exchange that asked for it."""

    request_id: str  # the ID the request was keyed by (header, body request_id or rid)
    engine_ids: tuple[str, ...]  # what aborts must name (all of them, for a multi-prompt one)
    response_id: str  # the `id` its response carries
    api: Api
    max_tokens: int
    token_interval: float
    prefill: float
    stall_after: int | None
    process: int = 0  # the front-end process it arrived at
    started_at: float = field(default_factory=time.monotonic)
    ended_at: float | None = None
    state: GenerationState = GenerationState.RUNNING
    stopped_by: str | None = None  # "abort" or "disconnect", for an aborted one
    # Each token as it is generated, with whether it is the last one; None once it ended.
    tokens: asyncio.Queue[tuple[str, bool] | None] = field(default_factory=asyncio.Queue)
    produced: int = 0
    token_times: list[float] = field(default_factory=list)  # time.monotonic() of each token
    aborted_ids: set[str] = field(default_factory=set)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    # llama.cpp: the conversation (X-Conversation-Id) a stream belongs to; such a stream
    # runs on after its client leaves.
    conversation: str | None = None

    @property
    def engine_id(self) -> str:
        return self.engine_ids[0]

    def produced_after(self, moment: float) -> int:
        """Tokens generated after `moment` (a time.monotonic() reading)."""
        return sum(1 for at in self.token_times if at > moment)

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
    connection: int = 0  # which connection the call came on (numbered as accepted)


# vLLM's default system fingerprint, from its config (here a constant).
FINGERPRINT = "fp_fake0032"


def _compact(document: object) -> bytes:
    return json.dumps(document, separators=(",", ":")).encode()


class FakeEngine:
    def __init__(
        self,
        *,
        abort_route: AbortRoute = AbortRoute.DEV,
        token_interval: float = 0.01,
        max_tokens: int = 16,
        hears_disconnects: bool = False,
        front_end_processes: int = 1,
        identifiable: bool = True,
        slots: int = 4,
    ) -> None:
        self.abort_route = abort_route
        # Says what it is where the engine it plays would (vLLM's /version and its model
        # cards' owner, SGLang's /model_info), or nothing tether could recognise.
        self.identifiable = identifiable
        self.front_end_processes = front_end_processes
        # Connection (its client address) → its number, in the order connections were seen.
        self._connections: dict[object, int] = {}
        self.token_interval = token_interval
        self.max_tokens = max_tokens
        self.hears_disconnects = hears_disconnects
        self.healthy = True
        self.abort_failures = 0  # answer this many abort calls with 503 first
        self.abort_hangs = False
        # Accept this many abort calls (200) and act on none: an abort naming a wrong ID, or
        # one that overtook its request at the engine.
        self.ignore_aborts = 0
        # Seconds from an abort call's answer until it ends its requests: an engine whose
        # scheduler acts on aborts at a later step (SGLang's, under load).
        self.abort_takes = 0.0
        # Seconds each abort call takes to answer, and the most calls seen in flight at once
        # (how many engine connections one abort holds).
        self.abort_answer_delay = 0.0
        self.aborts_in_flight = 0
        self.peak_aborts_in_flight = 0
        self._pending_aborts: set[asyncio.Task[None]] = set()
        self.print_aborts = False  # the CLI prints each abort call it honours
        self.requests: list[SeenRequest] = []
        self.generations: dict[str, Generation] = {}
        self.aborts: list[SeenAbort] = []
        self.disconnects: list[tuple[str, float]] = []
        # llama.cpp: the live stream of each conversation.
        self.conversations: dict[str, Generation] = {}
        # llama.cpp: requests generating at once (`-np`); the rest wait in its queue, blind to
        # their clients leaving (it looks only when a one-second wait passes without any
        # request's result).
        self.slots = slots
        self._free_slots = asyncio.Semaphore(slots)
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

    def connection_number(self, request: web.Request) -> int:
        """Which connection `request` came on, numbered as connections were first seen."""
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return self._connections.setdefault(peer, len(self._connections))

    def process_of(self, request: web.Request) -> int:
        """The front-end process `request`'s connection belongs to: whichever accepted it,
        which with several processes is as good as random (seeded by the connection's
        number, so a test run is repeatable)."""
        if self.front_end_processes == 1:
            return 0
        return random.Random(self.connection_number(request)).randrange(self.front_end_processes)

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    # --- HTTP ---------------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        # Bodies of any size, as vLLM and SGLang take them (uvicorn and FastAPI set no limit),
        # not aiohttp's 1 MiB.
        app = web.Application(client_max_size=1 << 30)
        for path in _ROUTES:
            app.router.add_post(path, self._completions)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/version", self._version)
        app.router.add_get("/model_info", self._model_info)
        app.router.add_post(_DEV_ABORT, self._counted(self._abort_vllm))
        app.router.add_post(_SCALE_OUT_ABORT, self._counted(self._abort_vllm))
        app.router.add_post(sglang.ABORT_PATH, self._counted(self._abort_sglang))
        app.router.add_get("/props", self._props)
        app.router.add_delete(llamacpp.STOP_PATH, self._counted(self._stop_conversation))
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

    @property
    def _plays_sglang(self) -> bool:
        return self.abort_route is AbortRoute.SGLANG

    @property
    def plays_llamacpp(self) -> bool:
        return self.abort_route is AbortRoute.LLAMACPP

    async def _models(self, request: web.Request) -> web.Response:
        card: dict[str, object] = {"id": "fake", "object": "model"}
        if self.identifiable:
            card["owned_by"] = (
                "sglang" if self._plays_sglang else "llamacpp" if self.plays_llamacpp else "vllm"
            )
        return web.json_response({"object": "list", "data": [card]})

    async def _version(self, request: web.Request) -> web.Response:
        """vLLM's `/version` (SGLang serves none)."""
        if not self.identifiable or self._plays_sglang or self.plays_llamacpp:
            raise web.HTTPNotFound()
        return web.json_response({"version": "0.32.0+fake"})

    async def _props(self, request: web.Request) -> web.Response:
        """llama.cpp's `/props` (the others serve none)."""
        if not self.identifiable or not self.plays_llamacpp:
            raise web.HTTPNotFound()
        settings = {"n_ctx": 4096, "params": {"seed": -1}}
        return web.json_response(
            {
                "default_generation_settings": settings,
                "total_slots": self.slots,
                "model_path": "/models/fake.gguf",
                "build_info": "b11434-fake",
            }
        )

    async def _model_info(self, request: web.Request) -> web.Response:
        """SGLang's `/model_info` (vLLM serves none)."""
        if not self.identifiable or not self._plays_sglang:
            raise web.HTTPNotFound()
        return web.json_response(
            {"model_path": "fake", "tokenizer_path": "fake", "is_generation": True}
        )

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
        answer_status = knobs.get("answer_status")
        if answer_status is not None:
            await asyncio.sleep(float(knobs.get("head_after", 0.0)))
            return self._error(int(answer_status))
        if self.plays_llamacpp:
            await self._slot_for(request, body, payload, knobs)
        generation = self._new_generation(request, body, payload, knobs)
        generation.process = self.process_of(request)
        running = self.generations.get(generation.request_id)
        if (
            self.abort_route is AbortRoute.SGLANG
            and running is not None
            and running.state is GenerationState.RUNNING
        ):
            await self._notify()  # SGLang refuses a rid that is already in flight
            return web.json_response(
                {"object": "error", "message": "Duplicate request ID detected", "code": 400},
                status=400,
            )
        self.generations[generation.request_id] = generation
        if generation.conversation is not None:
            # One live stream per conversation: a second POST cuts the first.
            replaced = self.conversations.get(generation.conversation)
            if replaced is not None and replaced.state is GenerationState.RUNNING:
                replaced.stopped_by = "replaced"
                replaced.end(GenerationState.ABORTED)
            self.conversations[generation.conversation] = generation
        self._start(generation)
        await self._notify()
        try:
            if payload.get("stream"):
                return await self._stream(request, generation, payload, knobs)
            return await self._whole(generation)
        except (asyncio.CancelledError, ConnectionError):
            self.disconnects.append((generation.request_id, time.monotonic()))
            # (a llama.cpp conversation stream runs on, detached from its client)
            if (
                self.hears_disconnects
                and generation.conversation is None
                and generation.state is GenerationState.RUNNING
            ):
                generation.stopped_by = "disconnect"
                generation.end(GenerationState.ABORTED)
            await self._notify()
            raise

    async def _slot_for(
        self, request: web.Request, body: bytes, payload: dict[str, Any], knobs: dict[str, Any]
    ) -> None:
        """llama-server's queue: a free slot, in turn. A client that leaves meanwhile goes
        unseen: its request takes the slot once one frees and runs until its first token's
        write finds the connection gone (to its end, without `hears_disconnects`)."""
        slot = asyncio.ensure_future(self._free_slots.acquire())
        try:
            await asyncio.shield(slot)
        except asyncio.CancelledError:
            task = asyncio.get_running_loop().create_task(
                self._run_for_nobody(slot, request, body, payload, knobs)
            )
            self._pending_aborts.add(task)
            task.add_done_callback(self._pending_aborts.discard)
            raise

    async def _run_for_nobody(
        self,
        slot: Awaitable[object],
        request: web.Request,
        body: bytes,
        payload: dict[str, Any],
        knobs: dict[str, Any],
    ) -> None:
        await slot
        generation = self._new_generation(request, body, payload, knobs)
        self.generations[generation.request_id] = generation
        self._start(generation)
        if payload.get("stream") and self.hears_disconnects:
            await generation.tokens.get()  # its first write: the connection is gone
            self.disconnects.append((generation.request_id, time.monotonic()))
            generation.stopped_by = "disconnect"
            generation.end(GenerationState.ABORTED)
        await self._notify()

    @staticmethod
    def _error(status: int) -> web.Response:
        """vLLM's error answer (`ErrorResponse`), as it refuses a request it cannot serve."""
        error = {
            "message": f"the fake engine answers {status}",
            "type": "BadRequestError" if status < 500 else "InternalServerError",
            "param": None,
            "code": status,
        }
        return web.json_response({"error": error}, status=status)

    def _new_generation(
        self, request: web.Request, body: bytes, payload: dict[str, Any], knobs: dict[str, Any]
    ) -> Generation:
        api = _ROUTES[request.path]
        route: Route | None
        if self.plays_llamacpp:
            # It ignores every ID it is given and mints its own.
            request_id = _alphanumerics()
            named = request_id
            route = None
        elif self.abort_route is AbortRoute.SGLANG:
            route = _SGLANG_ROUTES.get(request.path)
            # X-Override-Rid wins where SGLang takes header overrides (tether's rid in both).
            request_id = str(
                request.headers.get(sglang.RID_HEADER)
                or payload.get(sglang.RID.name)
                or os.urandom(16).hex()
            )
            named = request_id
        else:
            route = _VLLM_ROUTES.get(request.path)
            keyed_by = _body_key(route)
            if keyed_by is not None:
                # The Responses API ignores X-Request-Id and names the request from the body.
                default = keyed_by.value.format(id=os.urandom(8).hex())
                request_id = str(payload.get(keyed_by.name) or default)
                named = keyed_by.id_in(request_id)
            else:
                request_id = (
                    request.headers.get(REQUEST_ID_HEADER)
                    or payload.get(vllm.REQUEST_ID.name)
                    or os.urandom(8).hex()
                )
                named = request_id
        if self.plays_llamacpp:
            engine_ids: tuple[str, ...] = (request_id,)
            response_id = llamacpp.MINTED_ID_PREFIX + request_id
        elif route is None:  # a route the engine's table does not name: keyed as it is
            engine_ids = (request_id,)
            response_id = request_id
        else:
            # A batch (a list of prompts) runs as one engine request per prompt.
            batch = route.batch(JsonObject(body, route.fan_out)) if route.fan_out and body else None
            engine_ids = route.engine_request_ids(named, batch)
            response_id = route.answer_id(named)
        return Generation(
            request_id=request_id,
            engine_ids=engine_ids,
            response_id=response_id,
            api=api,
            max_tokens=int(
                payload.get("max_tokens", payload.get("max_output_tokens", self.max_tokens))
            ),
            token_interval=float(knobs.get("token_interval", self.token_interval)),
            prefill=float(knobs.get("prefill", 0.0)),
            stall_after=knobs.get("stall_after"),
            conversation=(
                request.headers.get(llamacpp.CONVERSATION_HEADER)
                if self.plays_llamacpp and payload.get("stream")
                else None
            ),
        )

    def _start(self, generation: Generation) -> None:
        """Its tokens begin; playing llama.cpp, its slot frees when they end."""
        generation.task = asyncio.get_running_loop().create_task(self._generate(generation))
        if self.plays_llamacpp:
            generation.task.add_done_callback(lambda _: self._free_slots.release())

    async def _generate(self, generation: Generation) -> None:
        """Produce tokens until done or aborted; the HTTP side only reads them."""
        try:
            await asyncio.sleep(generation.prefill)
            for index in range(generation.max_tokens):
                if generation.state is not GenerationState.RUNNING:
                    return
                if generation.stall_after is not None and index >= generation.stall_after:
                    await asyncio.Event().wait()  # stuck engine: never another token
                generation.tokens.put_nowait((f" tok{index}", index == generation.max_tokens - 1))
                generation.produced += 1
                generation.token_times.append(time.monotonic())
                await self._notify()
                await asyncio.sleep(generation.token_interval)
            generation.end(GenerationState.COMPLETED)
        finally:
            await self._notify()

    # --- streaming ----------------------------------------------------------------------

    async def _stream(
        self,
        request: web.Request,
        generation: Generation,
        payload: dict[str, Any],
        knobs: dict[str, Any],
    ) -> web.StreamResponse:
        await asyncio.sleep(float(knobs.get("head_after", 0.0)))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        fail_after = knobs.get("fail_after")
        include_usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        sent = 0
        async for event in self._events(generation, include_usage):
            if fail_after is not None and sent >= fail_after:
                assert request.transport is not None
                request.transport.abort()  # crash mid-stream
                return response
            await response.write(event)
            sent += 1
        cut = self.plays_llamacpp and generation.state is GenerationState.ABORTED
        if generation.api in (Api.CHAT, Api.COMPLETION, Api.GENERATE) and not cut:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _events(self, generation: Generation, include_usage: bool) -> AsyncIterator[bytes]:
        """The stream's events: each token as soon as it is generated, finish_reason on the
        last one (`length`), or one more event naming the abort."""
        api = generation.api
        item = await generation.tokens.get()  # like vLLM, the opening waits for prefill
        for event in self._opening(generation):
            yield event
        while item is not None:
            token, last = item
            yield self._token_event(generation, token, "length" if last else None, include_usage)
            item = await generation.tokens.get()
        if generation.state is GenerationState.ABORTED and not self.plays_llamacpp:
            if api in (Api.CHAT, Api.COMPLETION, Api.GENERATE):
                yield self._token_event(generation, "", "abort", include_usage)
        for event in self._closing(generation, include_usage):
            yield event

    def _opening(self, generation: Generation) -> list[bytes]:
        if generation.api is Api.CHAT:
            return [self._sse(self._chat_chunk(generation, {"role": "assistant", "content": ""}))]
        if generation.api is Api.MESSAGES:
            message = {"id": generation.response_id, "type": "message", "role": "assistant"}
            return [self._sse({"type": "message_start", "message": message}, "message_start")]
        if generation.api is Api.RESPONSES:
            created = {"id": generation.response_id, "status": "in_progress", "usage": None}
            return [
                self._sse({"response": created, "type": "response.created"}, "response.created")
            ]
        return []

    def _token_event(
        self, generation: Generation, token: str, reason: str | None, include_usage: bool
    ) -> bytes:
        api = generation.api
        # Like vLLM 0.32: the finishing chunk carries the system fingerprint, unless the
        # stream reports usage (then its usage event does).
        fingerprint: dict[str, Any] = (
            {"system_fingerprint": FINGERPRINT} if reason and not include_usage else {}
        )
        if reason and self.plays_llamacpp and not include_usage:
            fingerprint["timings"] = self._timings(generation)
        if api is Api.CHAT:
            return self._sse(
                {**self._chat_chunk(generation, {"content": token}, reason), **fingerprint}
            )
        if api is Api.COMPLETION:
            choice = {"index": 0, "text": token, "logprobs": None, "finish_reason": reason}
            return self._sse(
                {**self._chunk(generation, "text_completion", [choice]), **fingerprint}
            )
        if api is Api.GENERATE:
            meta: dict[str, Any] = {"id": generation.response_id, "finish_reason": reason}
            meta["completion_tokens"] = generation.produced
            return self._sse({"text": token, "meta_info": meta})
        if api is Api.MESSAGES:
            delta = {"type": "text_delta", "text": token}
            event = {"type": "content_block_delta", "delta": delta, "index": 0}
            return self._sse(event, "content_block_delta")
        delta_event = {"delta": token, "type": "response.output_text.delta"}
        return self._sse(delta_event, "response.output_text.delta")

    def _closing(self, generation: Generation, include_usage: bool) -> list[bytes]:
        api = generation.api
        usage = {"prompt_tokens": 3, "total_tokens": 3 + generation.produced}
        usage["completion_tokens"] = generation.produced
        if api in (Api.CHAT, Api.COMPLETION):
            if not include_usage:
                return []
            kind = "chat.completion.chunk" if api is Api.CHAT else "text_completion"
            chunk = {**self._chunk(generation, kind, []), "usage": usage}
            if self.plays_llamacpp:  # timings move to the usage event
                chunk["timings"] = self._timings(generation)
            return [self._sse({**chunk, "system_fingerprint": FINGERPRINT})]
        if api is Api.MESSAGES:
            output = {"input_tokens": 3, "output_tokens": generation.produced}
            aborted = generation.state is GenerationState.ABORTED
            delta = {"stop_reason": None if aborted else "max_tokens"}
            return [
                self._sse(
                    {"type": "message_delta", "delta": delta, "usage": output}, "message_delta"
                ),
                self._sse({"type": "message_stop"}, "message_stop"),
            ]
        if api is Api.RESPONSES:
            done = {
                "id": generation.response_id,
                "status": "completed",
                "usage": {"input_tokens": 3, "output_tokens": generation.produced},
            }
            return [
                self._sse({"response": done, "type": "response.completed"}, "response.completed")
            ]
        return []

    def _chat_chunk(
        self, generation: Generation, delta: dict[str, str], reason: str | None = None
    ) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        return self._chunk(generation, "chat.completion.chunk", [choice])

    @staticmethod
    def _chunk(generation: Generation, kind: str, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": generation.response_id,
            "object": kind,
            "created": int(time.time()),
            "model": "fake",
            "choices": choices,
        }

    @staticmethod
    def _timings(generation: Generation) -> dict[str, Any]:
        """llama.cpp's figures: the prompt's tokens from the slot's cache and computed, and
        those generated."""
        return {"cache_n": 1, "prompt_n": 2, "predicted_n": generation.produced}

    @staticmethod
    def _sse(document: object, event: str | None = None) -> bytes:
        head = f"event: {event}\n".encode() if event is not None else b""
        return head + b"data: " + _compact(document) + b"\n\n"

    # --- non-streaming ----------------------------------------------------------------------

    async def _whole(self, generation: Generation) -> web.Response:
        await generation.ended.wait()
        text = []
        while not generation.tokens.empty():
            item = generation.tokens.get_nowait()
            if item is not None:
                text.append(item[0])
        content = "".join(text)
        aborted = generation.state is GenerationState.ABORTED
        reason = "abort" if aborted else "length"
        usage = {"prompt_tokens": 3, "total_tokens": 3 + generation.produced}
        usage["completion_tokens"] = generation.produced
        document: dict[str, Any]
        if generation.api is Api.MESSAGES:
            document = {
                "id": generation.response_id,
                "type": "message",
                "content": [{"type": "text", "text": content}],
                "usage": {"input_tokens": 3, "output_tokens": generation.produced},
            }
        elif generation.api is Api.RESPONSES:
            document = {
                "id": generation.response_id,
                "status": "completed",
                "output": [{"type": "message", "content": [{"text": content}]}],
                "usage": {"input_tokens": 3, "output_tokens": generation.produced},
            }
        elif generation.api is Api.GENERATE:
            finished: dict[str, Any] = {"id": generation.response_id}
            finished["finish_reason"] = {"type": reason}
            finished["completion_tokens"] = generation.produced
            document = {"text": content, "meta_info": finished}
        elif generation.api is Api.COMPLETION:
            choice = {"index": 0, "text": content, "finish_reason": reason}
            document = {**self._chunk(generation, "text_completion", [choice]), "usage": usage}
        else:
            message = {"role": "assistant", "content": content}
            choice = {"index": 0, "message": message, "finish_reason": reason}
            document = {**self._chunk(generation, "chat.completion", [choice]), "usage": usage}
        if self.plays_llamacpp:
            document["timings"] = self._timings(generation)
        return web.Response(body=_compact(document), content_type="application/json")

    # --- abort routes -------------------------------------------------------------------

    def _counted(self, handler: _Handler) -> _Handler:
        """An abort handler whose calls in flight are counted (and delayed, if asked)."""

        async def counted(request: web.Request) -> web.Response:
            self.aborts_in_flight += 1
            self.peak_aborts_in_flight = max(self.peak_aborts_in_flight, self.aborts_in_flight)
            try:
                if self.abort_answer_delay > 0:
                    await asyncio.sleep(self.abort_answer_delay)
                return await handler(request)
            finally:
                self.aborts_in_flight -= 1

        return counted

    async def _abort_vllm(self, request: web.Request) -> web.Response:
        route_on = {
            _DEV_ABORT: self.abort_route is AbortRoute.DEV,
            _SCALE_OUT_ABORT: self.abort_route is AbortRoute.SCALE_OUT,
        }[request.path]
        if not route_on:
            status = 403 if request.path == _SCALE_OUT_ABORT else 404
            self.aborts.append(
                SeenAbort(
                    request.path, (), status, time.monotonic(), self.connection_number(request)
                )
            )
            await self._notify()
            return web.json_response({"detail": "Not Found"}, status=status)
        payload = await request.json()
        ids = tuple(payload.get("request_ids") or ())
        failure = await self._injected_failure(request, ids)
        if failure is not None:
            return failure
        # Like vLLM's dev route: exact matches of external IDs held by this process; an empty
        # list aborts every running request.
        process = self.process_of(request)
        targets = [
            g
            for g in self.generations.values()
            if g.process == process and (not ids or set(g.engine_ids) & set(ids))
        ]
        for generation in targets:
            generation.aborted_ids.update(ids if ids else generation.engine_ids)
        targets = [g for g in targets if generation_fully_aborted(g)]
        return await self._abort(request, ids, targets, {"status": "aborted", "aborted": len(ids)})

    async def _stop_conversation(self, request: web.Request) -> web.Response:
        """llama.cpp's `DELETE /v1/stream?conv_id=<id>`: stops the conversation's stream
        (its body then ends with neither a finish reason nor `[DONE]`); 204 whatever the ID."""
        if not self.plays_llamacpp:
            return web.json_response({"detail": "Not Found"}, status=404)
        conversation = request.query.get("conv_id", "")
        if not conversation:
            return web.json_response({"error": "Missing conversation id"}, status=400)
        failure = await self._injected_failure(request, (conversation,))
        if failure is not None:
            return failure
        generation = self.conversations.pop(conversation, None)
        self.aborts.append(
            SeenAbort(
                request.path,
                (conversation,),
                204,
                time.monotonic(),
                self.connection_number(request),
            )
        )
        if generation is not None and generation.state is GenerationState.RUNNING:
            generation.stopped_by = "abort"
            generation.end(GenerationState.ABORTED)
        await self._notify()
        return web.Response(status=204)

    async def _abort_sglang(self, request: web.Request) -> web.Response:
        if self.abort_route is not AbortRoute.SGLANG:
            return web.json_response({"detail": "Not Found"}, status=404)
        payload = await request.json()
        rid = str(payload.get("rid") or "")
        failure = await self._injected_failure(request, (rid,))
        if failure is not None:
            return failure
        # Like SGLang: a rid its tokenizer manager does not hold exactly (an empty one, a
        # batch's `<rid>` for its `<rid>_<index>` items) is ignored; else its scheduler aborts
        # every request starting with it, so unique fixed-length rids matter.
        process = self.process_of(request)
        running = [
            g
            for g in self.generations.values()
            if g.state is GenerationState.RUNNING and g.process == process
        ]
        held = any(rid in generation.engine_ids for generation in running)
        targets = []
        for generation in running if held else ():
            matched = {
                engine_id for engine_id in generation.engine_ids if engine_id.startswith(rid)
            }
            generation.aborted_ids.update(matched)
            if matched:
                targets.append(generation)
        targets = [g for g in targets if generation_fully_aborted(g)]
        return await self._abort(request, (rid,), targets, None)

    async def _injected_failure(
        self, request: web.Request, ids: tuple[str, ...]
    ) -> web.Response | None:
        connection = self.connection_number(request)
        if self.abort_hangs:
            self.aborts.append(SeenAbort(request.path, ids, 0, time.monotonic(), connection))
            await self._notify()
            await asyncio.Event().wait()
        if self.abort_failures > 0:
            self.abort_failures -= 1
            self.aborts.append(SeenAbort(request.path, ids, 503, time.monotonic(), connection))
            await self._notify()
            return web.json_response({"error": "busy"}, status=503)
        return None

    async def _abort(
        self, request: web.Request, ids: tuple[str, ...], targets: list[Generation], reply: object
    ) -> web.Response:
        path = request.path
        self.aborts.append(
            SeenAbort(path, ids, 200, time.monotonic(), self.connection_number(request))
        )
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
        if self.ignore_aborts > 0:
            self.ignore_aborts -= 1
        elif self.abort_takes > 0:
            task = asyncio.create_task(self._end_aborted(targets, self.abort_takes))
            self._pending_aborts.add(task)
            task.add_done_callback(self._pending_aborts.discard)
        else:
            await self._end_aborted(targets, 0.0)
        await self._notify()
        return web.json_response(reply) if reply is not None else web.Response(status=200)

    async def _end_aborted(self, targets: list[Generation], after: float) -> None:
        if after:
            await asyncio.sleep(after)
        for generation in targets:
            if generation.state is GenerationState.RUNNING:
                generation.stopped_by = "abort"
            generation.end(GenerationState.ABORTED)
        await self._notify()


def _alphanumerics(count: int = 32) -> str:
    """llama.cpp's `random_string`."""
    return "".join(random.choices(string.ascii_letters + string.digits, k=count))


def _body_key(route: Route | None) -> BodyField | None:
    """The body field a vLLM route names its request by whatever the header says (the one
    tether always writes: the Responses API's `request_id`); None where the header wins."""
    if route is None:
        return None
    return next((field for field in route.body_fields if field.always), None)


def generation_fully_aborted(generation: Generation) -> bool:
    """Every engine request of a generation was named (a multi-prompt completion runs one per
    prompt; naming one leaves the others running)."""
    return set(generation.engine_ids) <= generation.aborted_ids


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
    parser.add_argument(
        "--anonymous",
        action="store_true",
        help="say nothing of what it is (no /version, /model_info or model owner): "
        "tether's auto engine then cannot identify it",
    )
    args = parser.parse_args()
    engine = FakeEngine(
        abort_route=args.abort_route,
        token_interval=args.token_interval,
        max_tokens=args.max_tokens,
        hears_disconnects=args.hears_disconnects,
        identifiable=not args.anonymous,
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
