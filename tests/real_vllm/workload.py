"""Clients that count the tokens they receive and leave when told, and the mixed run of many
of them that measures how much work abandoned requests cost the engine."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..support.raw_http import RawExchange
from .processes import Stack
from .scenarios import ROUTES, GenerationRoute


def counted(body: dict[str, Any], include_usage: bool = False) -> dict[str, Any]:
    """`body` (chat or completions) with vLLM's `return_token_ids`, so that every event says
    exactly which tokens it carries; `include_usage` adds the stream's final usage event."""
    extra: dict[str, Any] = {"return_token_ids": True}
    if include_usage:
        extra["stream_options"] = {"include_usage": True}
    return {**body, **extra}


def tokens_in(event: str) -> int:
    """Generated tokens in one chat/completions event or JSON answer sent with
    `return_token_ids` (the role-only first chat event carries none)."""
    if event == "[DONE]":
        return 0
    data = json.loads(event)
    return sum(len(choice.get("token_ids") or []) for choice in data.get("choices", []))


# Tokens per request of the mixed run: about 0.5-2 s each at its concurrency.
MIN_TOKENS, MAX_TOKENS = 96, 320


class Fate(StrEnum):
    """What a client of the mixed run does."""

    READS_TO_THE_END = "reads to the end"
    LEAVES_BEFORE_FIRST_TOKEN = "leaves before the first token"
    LEAVES_MID_STREAM = "leaves mid-stream"


@dataclass(frozen=True)
class Plan:
    """One client of a run: its request and when it leaves."""

    client_request_id: str
    route: GenerationRoute
    max_tokens: int
    fate: Fate
    leave_after: int = 0  # token-carrying events read before leaving mid-stream
    delay: float = 0.0  # seconds after sending before leaving without a token
    include_usage: bool = False  # `stream_options.include_usage`: the engine's own count

    def body(self) -> dict[str, Any]:
        return counted(self.route.body(self.max_tokens, stream=True), self.include_usage)


@dataclass
class Departure:
    """What a client received before it left or its stream ended."""

    plan: Plan
    tokens: int = 0  # generated tokens received (counted from `token_ids`)
    left: bool = False
    closed_at: float | None = None  # wall-clock time of the close, to compare with vLLM's log


def take_and_leave(exchange: RawExchange, departure: Departure) -> Departure:
    """Count what already arrived, then close: what a client that leaves now received."""
    departure.tokens += sum(tokens_in(event) for event in exchange.events_ready())
    departure.left = True
    departure.closed_at = time.time()
    exchange.close()
    return departure


def run_client(stack: Stack, plan: Plan) -> Departure:
    """Send `plan`'s streaming request through tether and follow its fate."""
    departure = Departure(plan)
    with RawExchange(
        stack.tether.port, plan.route.path, plan.body(), {"X-Request-Id": plan.client_request_id}
    ) as exchange:
        if plan.fate is Fate.LEAVES_BEFORE_FIRST_TOKEN:
            time.sleep(plan.delay)  # the client's own think time, not a wait for a condition
            return take_and_leave(exchange, departure)
        assert exchange.read_head() == 200, exchange.status
        events = 0
        for event in exchange.events():
            tokens = tokens_in(event)
            departure.tokens += tokens
            events += 1 if tokens else 0
            if plan.fate is Fate.LEAVES_MID_STREAM and events >= plan.leave_after:
                return take_and_leave(exchange, departure)
    return departure


def mixed_plans(prefix: str, count: int, seed: int) -> list[Plan]:
    """Streaming chat and completions clients: about half read to the end, the others leave
    at a random event or, some, before the first token."""
    rng = random.Random(seed)
    plans = []
    for index in range(count):
        route = ROUTES[rng.choice(("chat", "completions"))]
        max_tokens = rng.randint(MIN_TOKENS, MAX_TOKENS)
        draw = rng.random()
        client_request_id = f"{prefix}-{index}"
        if draw < 0.5:
            plan = Plan(client_request_id, route, max_tokens, Fate.READS_TO_THE_END)
        elif draw < 0.62:  # some 12 %
            plan = Plan(
                client_request_id,
                route,
                # Long, so that none can finish before it is stopped, however late.
                MAX_TOKENS,
                Fate.LEAVES_BEFORE_FIRST_TOKEN,
                delay=rng.uniform(0.0, 0.05),
            )
        else:
            plan = Plan(
                client_request_id,
                route,
                max_tokens,
                Fate.LEAVES_MID_STREAM,
                # Well before the end, so that no leaver's request can finish on its own.
                leave_after=rng.randint(1, max_tokens - 20),
            )
        plans.append(plan)
    return plans


def run_mixed(stack: Stack, plans: list[Plan], concurrency: int) -> list[Departure]:
    """Every plan, `concurrency` clients at a time, each on its own connection."""
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="client") as pool:
        return list(pool.map(lambda plan: run_client(stack, plan), plans))
