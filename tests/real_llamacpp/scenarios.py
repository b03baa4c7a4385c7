"""Steps the tests share: requests to llama-server's chat route, straight or through tether, and
the phases a client can leave in, each measured from llama-server's own log (`server_log`):
the seconds from the client's close until llama-server let the request go, and how."""

from __future__ import annotations

import json
import random
import string
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from typing import Any

import pytest

from ..support.blocking_http import http_post_json
from ..support.raw_http import RawExchange
from ..support.real_engine.measurements import Measurements
from ..support.real_engine.stacks import MODEL_NAME
from ..support.waiting import wait_until
from .measurements import ALONE, NOT_STOPPED, VIA_TETHER, record
from .processes import TWO_SLOTS, Stack
from .server_log import ServerLog, TaskEvent

CHAT_PATH = "/v1/chat/completions"
on_two_slots = pytest.mark.parametrize("stack", [TWO_SLOTS.name], indirect=True)

# Tokens an answer may run to: more than any test waits for (the tiny model never ends an
# answer by itself; llama-server's slots hold SLOT_CONTEXT tokens).
LONG = 12000
# A prompt whose prefill takes two batches of 2,048 tokens, seconds on one core: the tiny
# vocabulary makes about 0.87 tokens of a character of these words (measured: 3,000 tokens,
# 1.3 s for the first batch, about 3 s in all).
LONG_PROMPT_CHARACTERS = 3450
PREFILL_SECONDS = 3.0
# Seconds llama-server takes at most to notice a client that left while nothing else
# produced results: its one-second wait, plus a loaded 2-core machine.
ITS_TIMER = 1.0
NOTICED_WITHIN = ITS_TIMER + 0.6
# Seconds from a close during prefill until the slot is released: noticed at its one-second
# wait, the cancel taken once the batch in progress is done (1.3 s, more on a loaded
# machine), the same allowance.
PREFILL_STOP_WITHIN = ITS_TIMER + 2 * 1.3 + 0.6
# Seconds a measurement waits for llama-server to let go before it records "not stopped".
WINDOW = 3.0
# Other clients' answers the scenarios run beside (tokens), and about how long each takes at
# most (seconds: measured at load average 4, 430 tokens a second for one stream, 170 for each
# of two; about 1,700 for one on a quiet core).
TOKENS_PER_SECOND = 100
SHORT_STREAM = 300
SHORT_STREAM_SECONDS = SHORT_STREAM / TOKENS_PER_SECOND
QUEUED_ANSWER = 300
QUEUED_ANSWER_SECONDS = QUEUED_ANSWER / TOKENS_PER_SECOND
BESIDE_ANSWER = 1000
BESIDE_ANSWER_SECONDS = BESIDE_ANSWER / TOKENS_PER_SECOND


def chat(max_tokens: int, stream: bool, prompt: str = "Tell me a long story.", **extra: Any) -> Any:
    """A chat request that generates exactly `max_tokens` tokens (the tiny model never ends an
    answer by itself)."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }


def long_prompt(seed: str) -> str:
    """Random words (the same for the same seed) making about 3,000 tokens."""
    rng = random.Random(seed)
    words: list[str] = []
    length = 0
    while length < LONG_PROMPT_CHARACTERS:
        word = "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
        words.append(word)
        length += len(word) + 1
    return " ".join(words)


def direct(stack: Stack, payload: Any, headers: dict[str, str] | None = None) -> RawExchange:
    """`payload` sent straight to llama-server by the raw client."""
    return RawExchange(stack.llamacpp.port, CHAT_PATH, payload, headers or {})


def via_tether(
    stack: Stack, client_request_id: str, payload: Any, headers: dict[str, str] | None = None
) -> RawExchange:
    """`payload` sent through tether as `client_request_id` by the same raw client."""
    return RawExchange(
        stack.tether.port,
        CHAT_PATH,
        payload,
        {"X-Request-Id": client_request_id, **(headers or {})},
    )


def send(
    stack: Stack, way: str, name: str, payload: Any, headers: dict[str, str] | None = None
) -> RawExchange:
    """`payload` sent the `way` being measured (ALONE or VIA_TETHER)."""
    if way == VIA_TETHER:
        return via_tether(stack, name, payload, headers)
    assert way == ALONE, way
    return direct(stack, payload, headers)


def stop_conversation(stack: Stack, conversation_id: str) -> int:
    """llama-server's own stop of a conversation stream, `DELETE /v1/stream?conv_id=<id>`,
    straight to it; the status."""
    request = urllib.request.Request(
        f"{stack.llamacpp.url}/v1/stream?conv_id={conversation_id}", method="DELETE"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


def prompt_tokens(stack: Stack, payload: Any) -> int:
    """The tokens llama-server makes of a chat request's prompt (its template applied, the
    BOS token included): `/apply-template` then `/tokenize`, asked before a measurement."""
    status, _, body = http_post_json(
        stack.llamacpp.url + "/apply-template", {"messages": payload["messages"]}
    )
    assert status == 200, body[:200]
    prompt = json.loads(body)["prompt"]
    status, _, body = http_post_json(
        stack.llamacpp.url + "/tokenize",
        {"content": prompt, "add_special": True, "parse_special": True},
    )
    assert status == 200, body[:200]
    return len(json.loads(body)["tokens"])


@dataclass(frozen=True)
class Stop:
    """How llama-server let a request go after its client left."""

    # From the client's close to the slot's release (or, for a request still queued, to the
    # cancel that dropped it); WINDOW if it had not let go by then.
    seconds: float
    # CANCELLED: llama-server noticed the close; RAN_TO_END: it did not, and finished the
    # answer; NOT_STOPPED: still running when the measurement gave up on it.
    ending: str
    ran: bool  # a slot took the request at some point
    generated: int  # tokens it generated in all (a NOT_STOPPED one: until it was stopped)
    received: int  # of those, tokens its client had received
    prompt: int = 0  # tokens of its prompt
    # A conversation stream NOT_STOPPED: seconds from `DELETE /v1/stream?conv_id=` to its
    # release.
    deleted_in: float | None = None

    @property
    def for_nobody(self) -> int:
        return self.generated - self.received


CANCELLED = "cancelled"
RAN_TO_END = "ran to its end"
# Through tether: dropped from tether's own queue, never sent to llama-server.
NEVER_SENT = "never sent"


def record_stop(measurements: Measurements, phase: str, way: str, stop: Stop) -> None:
    """One run of `phase`, in the suite's table."""
    record(measurements, phase, way, stop.seconds, stop.ending, stop.for_nobody, stop.deleted_in)


def _released(
    events: ServerLog,
    mark: int,
    task: int,
    closed: float,
    prompt: int,
    received: int,
    window: float,
) -> Stop:
    """The Stop of `task` (launched after `mark`) whose client closed at wall time `closed`:
    its release, once logged; NOT_STOPPED if it is still running `window` s after the close."""
    try:
        release = events.wait_released(mark, task, max(0.1, closed + window - time.time()))
    except AssertionError:
        return Stop(window, NOT_STOPPED, True, 0, received, prompt)
    cancelled = any(event.task == task for event in events.cancelled(mark))
    return Stop(
        events.wall(release) - closed,
        CANCELLED if cancelled else RAN_TO_END,
        True,
        _generated(release, prompt),
        received,
        prompt,
    )


def _generated(release: TaskEvent, prompt: int) -> int:
    """Tokens a task generated, from its release: the slot holds the prompt and every
    generated token but the last (sampled and sent, not yet decoded); fewer than the
    prompt, it was released during prefill."""
    in_slot = release.tokens or 0
    return in_slot + 1 - prompt if in_slot >= prompt else 0


def _launched(events: ServerLog, mark: int, known: set[int]) -> TaskEvent:
    """The first task launched after `mark` that is not in `known`."""
    found: list[TaskEvent] = []

    def new() -> bool:
        found[:] = [event for event in events.launched(mark) if event.task not in known]
        return bool(found)

    wait_until(new, 30.0, "llama-server to launch the task", interval=0.01)
    return found[0]


def _evidence(stack: Stack) -> ServerLog:
    """llama-server's log, its clock calibrated before anything is measured (the calibration
    is an HTTP call)."""
    events = stack.llamacpp.events
    events.offset()
    return events


def _close(exchange: RawExchange) -> float:
    """Close the client's connection; the wall time of the close."""
    closed = time.time()
    exchange.close()
    return closed


# --- the phases --------------------------------------------------------------------------


def leave_stream(
    stack: Stack, way: str, name: str, rng: random.Random, headers: dict[str, str] | None = None
) -> Stop:
    """A streaming client reads a few tokens and closes."""
    events = _evidence(stack)
    payload = chat(LONG, stream=True)
    prompt = prompt_tokens(stack, payload)
    mark = events.mark()
    exchange = send(stack, way, name, payload, headers)
    assert exchange.read_head() == 200
    received = len(exchange.chunks(rng.randint(3, 12))) - 1  # the first carries the role
    task = _launched(events, mark, set()).task
    closed = _close(exchange)
    return _released(events, mark, task, closed, prompt, received, WINDOW)


def leave_generating(stack: Stack, way: str, name: str, rng: random.Random) -> Stop:
    """A non-streaming client waits a moment while its answer is generated, and closes."""
    events = _evidence(stack)
    payload = chat(LONG, stream=False)
    prompt = prompt_tokens(stack, payload)
    mark = events.mark()
    exchange = send(stack, way, name, payload)
    task = _launched(events, mark, set()).task
    time.sleep(rng.uniform(0.05, 0.5))  # the client's patience: the scenario
    closed = _close(exchange)
    return _released(events, mark, task, closed, prompt, 0, WINDOW)


@contextmanager
def occupied(stack: Stack, *payloads: Any, way: str = ALONE) -> Iterator[list[int]]:
    """Other clients' requests, straight to llama-server (or through tether, where all of a
    pod's traffic goes), each launched in a slot before the next is sent; their tasks. On
    exit each is closed and its slot released (a stream at once, a non-streaming one at
    llama-server's next look)."""
    events = stack.llamacpp.events
    with ExitStack() as cleanup:
        tasks: list[int] = []
        exchanges: list[RawExchange] = []
        mark = events.mark()
        for index, payload in enumerate(payloads):
            exchange = cleanup.enter_context(send(stack, way, f"occupant-{index}", payload))
            exchanges.append(exchange)
            if payload["stream"]:
                assert exchange.read_head() == 200
                exchange.chunks(2)
            tasks.append(_launched(events, mark, set(tasks)).task)
        yield tasks
        for exchange in exchanges:
            exchange.close()
        for task in tasks:
            events.wait_released(mark, task, NOTICED_WITHIN + 5)


def _dropped_from_queue(
    stack: Stack, mark: int, occupants: list[int], closed: float, window: float
) -> tuple[int, Stop] | None:
    """The task cancelled while queued (not one of `occupants`) after `mark`, and its Stop;
    None if llama-server cancelled nothing within `window` s of the close."""
    events = stack.llamacpp.events
    found: list[TaskEvent] = []

    def cancelled() -> bool:
        found[:] = [e for e in events.cancelled(mark) if e.task not in occupants]
        return bool(found)

    try:
        wait_until(cancelled, max(0.1, closed + window - time.time()), "a cancel", 0.01)
    except AssertionError:
        return None
    return found[0].task, Stop(events.wall(found[0]) - closed, CANCELLED, False, 0, 0)


def leave_queued_behind_answer(stack: Stack, way: str, name: str, rng: random.Random) -> Stop:
    """With the only slot busy on another client's non-streaming answer, a client's request
    waits in the queue; the client waits a moment and closes."""
    events = _evidence(stack)
    mark = events.mark()
    with occupied(stack, chat(LONG, stream=False)) as occupants:
        exchange = send(stack, way, name, chat(LONG, stream=False))
        time.sleep(rng.uniform(0.2, 0.6))  # the client's patience: the scenario
        closed = _close(exchange)
        dropped = _dropped_from_queue(stack, mark, occupants, closed, WINDOW)
    assert dropped is not None, "llama-server never noticed the queued client leave"
    task, stop = dropped
    ran = any(event.task == task for event in events.launched(mark))
    return Stop(stop.seconds, stop.ending, ran, 0, 0)


def _next_of(
    stack: Stack, mark: int, occupants: list[int], closed: float, window: float
) -> TaskEvent | None:
    """The first task after `mark` besides `occupants` that llama-server either launched or
    cancelled; None if neither happened within `window` s of the close."""
    events = stack.llamacpp.events
    found: list[TaskEvent] = []

    def seen() -> bool:
        found[:] = [
            event
            for event in sorted(events.launched(mark) + events.cancelled(mark), key=lambda e: e.at)
            if event.task not in occupants
        ]
        return bool(found)

    try:
        wait_until(seen, max(0.1, closed + window - time.time()), "the queued task", 0.01)
    except AssertionError:
        return None
    return found[0]


def leave_queued_behind_streams(stack: Stack, way: str, name: str, rng: random.Random) -> Stop:
    """With both slots busy on other clients' streams (sent the same way), a client's
    non-streaming request waits in the queue (llama-server's, or tether's, which counts its
    slots); the client waits a moment and closes. The first stream then ends: straight, the
    request takes its slot while the second still streams; through tether, llama-server
    never sees it."""
    events = _evidence(stack)
    payload = chat(QUEUED_ANSWER, stream=False)
    prompt = prompt_tokens(stack, payload)
    mark = events.mark()
    occupants_sent = (chat(SHORT_STREAM, stream=True), chat(LONG, stream=True))
    with occupied(stack, *occupants_sent, way=way) as occupants:
        exchange = send(stack, way, name, payload)
        if way == VIA_TETHER:
            stack.tether.wait_in_flight(name)  # (listed once it is registered)
            wait_until(
                lambda: _tether_phase(stack, name) == "queued", 10.0, "tether to queue it", 0.01
            )
        time.sleep(rng.uniform(0.2, 0.6))  # the client's patience: the scenario
        closed = _close(exchange)
        if way == VIA_TETHER:
            wait_until(lambda: _tether_phase(stack, name) is None, 5.0, "tether to drop it", 0.01)
            dropped = time.time() - closed
        window = SHORT_STREAM_SECONDS + QUEUED_ANSWER_SECONDS + WINDOW
        first = _next_of(stack, mark, occupants, closed, window)
        if first is None:
            assert way == VIA_TETHER, "the queued request neither ran nor was cancelled"
            return Stop(dropped, NEVER_SENT, False, 0, 0)
        stop = _released(events, mark, first.task, closed, prompt, 0, window)
    ran = any(event.task == first.task for event in events.launched(mark))
    if not ran:  # dropped from the queue
        return Stop(events.wall(first) - closed, CANCELLED, False, 0, 0)
    return stop


def _tether_phase(stack: Stack, client_request_id: str) -> str | None:
    """The phase tether lists the request in; None once it is no longer in flight."""
    for entry in stack.tether.in_flight_requests():
        if entry.get("client_request_id") == client_request_id:
            return str(entry["phase"])
    return None


def leave_prefill(
    stack: Stack, way: str, name: str, rng: random.Random, headers: dict[str, str] | None = None
) -> Stop:
    """A streaming client sends a long prompt and gives up before its first token, while
    llama-server processes the prompt."""
    events = _evidence(stack)
    # Fresh every time: a prompt a slot has seen would be partly served from its cache.
    payload = chat(LONG, stream=True, prompt=long_prompt(f"{name}-{way}-{rng.random()}"))
    prompt = prompt_tokens(stack, payload)
    mark = events.mark()
    exchange = send(stack, way, name, payload, headers)
    task = _launched(events, mark, set()).task
    time.sleep(rng.uniform(0.1, 0.6))  # the client's patience: the scenario
    closed = _close(exchange)
    return _released(events, mark, task, closed, prompt, 0, PREFILL_SECONDS + WINDOW)


def leave_beside_stream(stack: Stack, way: str, name: str, rng: random.Random) -> Stop:
    """While another client streams, a client's non-streaming request is generated in the
    other slot; the client waits a moment and closes."""
    events = _evidence(stack)
    payload = chat(BESIDE_ANSWER, stream=False)
    prompt = prompt_tokens(stack, payload)
    with occupied(stack, chat(LONG, stream=True)) as occupants:
        mark = events.mark()
        exchange = send(stack, way, name, payload)
        task = _launched(events, mark, set(occupants)).task
        time.sleep(rng.uniform(0.05, 0.5))  # the client's patience: the scenario
        closed = _close(exchange)
        return _released(events, mark, task, closed, prompt, 0, BESIDE_ANSWER_SECONDS + WINDOW)


def leave_conversation(
    stack: Stack, way: str, name: str, rng: random.Random, prefill: bool
) -> Stop:
    """A streaming client with an `X-Conversation-Id` closes, mid-answer or during its
    prompt's prefill; if llama-server has not let go after a while, the conversation is
    stopped with its own `DELETE /v1/stream?conv_id=<id>` (the suite's cleanup, straight to
    llama-server)."""
    conversation_id = f"{name}-{rng.randrange(1 << 32):08x}"
    headers = {"X-Conversation-Id": conversation_id}
    events = stack.llamacpp.events
    mark = events.mark()
    if prefill:
        stop = leave_prefill(stack, way, name, rng, headers)
    else:
        stop = leave_stream(stack, way, name, rng, headers)
    if stop.ending != NOT_STOPPED:
        return stop
    (task,) = {event.task for event in events.launched(mark)}
    deleted = time.time()
    assert stop_conversation(stack, conversation_id) == 204
    release = events.wait_released(mark, task, NOTICED_WITHIN)
    generated = _generated(release, stop.prompt)
    return replace(stop, generated=generated, deleted_in=events.wall(release) - deleted)
