"""llama-server's routes that change the server for every client (shared/ENGINES.md §14.1,
README "Routes"): tether refuses them all (`/slots`, which also shows every slot's prompt and
answer, among them)."""

from __future__ import annotations

import json

import pytest

from ..support.blocking_http import http_get, http_post_json
from .processes import Stack
from .scenarios import on_two_slots


def _refused_by_tether(status: int, body: bytes) -> bool:
    """tether's own refusal of a blocked route: 403 and its error code."""
    if status != 403:
        return False
    return bool(json.loads(body).get("error", {}).get("code") == "blocked_route")


@on_two_slots
def test_slots_shown_straight_are_refused_through_tether(stack: Stack) -> None:
    """`GET /slots` answers straight from llama-server (every slot, on by default) and is
    refused by tether."""
    status, body = http_get(stack.llamacpp.url + "/slots")
    assert status == 200 and len(json.loads(body)) == stack.llamacpp.config.parallel
    assert _refused_by_tether(*http_get(stack.tether.url + "/slots"))


@on_two_slots
def test_slot_actions_are_refused_through_tether(stack: Stack) -> None:
    """`POST /slots/0?action=erase` (and save, restore) is refused by tether."""
    for action in ("erase", "save", "restore"):
        status, _, body = http_post_json(
            f"{stack.tether.url}/slots/0?action={action}", {"filename": "slot.bin"}
        )
        assert _refused_by_tether(status, body), (action, status, body[:200])


# Routes that change llama-server for every client, with a body that would act on it.
CONTROL_ROUTES = {
    # Every loaded adapter's scale, for all clients.
    "/lora-adapters": [],
    # Global properties (501 unless started with --props).
    "/props": {},
    # Ends a live completion's reasoning, by llama-server's completion ID.
    "/v1/chat/completions/control": {"id": "chatcmpl-x", "action": "reasoning_end"},
    # Router mode: load and unload models (404 on a single-model server).
    "/models/load": {"model": "tiny"},
    "/models/unload": {"model": "tiny"},
}


@on_two_slots
@pytest.mark.parametrize("path", list(CONTROL_ROUTES))
def test_control_route_is_refused_through_tether(stack: Stack, path: str) -> None:
    """A POST to a route that changes llama-server for every client is refused by tether."""
    status, _, body = http_post_json(stack.tether.url + path, CONTROL_ROUTES[path])
    assert _refused_by_tether(status, body), f"passed: {status} {body[:200]!r}"
