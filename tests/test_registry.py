"""The in-flight registry's prefix index: in preserve mode, in front of an engine that aborts
every request whose ID starts with the one named, it finds the in-flight ID a new one
overlaps (either is a prefix of the other), and nothing for IDs that do not overlap. And
shutdown's wait for it to empty."""

from __future__ import annotations

import asyncio

import pytest

from proxy.engines import Engine, engine_profile
from proxy.request.registry import Registry
from proxy.request.state import RequestState

from .support.settings import make_settings

pytestmark = pytest.mark.socket_free

SGLANG = engine_profile(make_settings(), Engine.SGLANG)


def registry_holding(*request_ids: str) -> Registry:
    registry = Registry(prefix_index=True)
    for request_id in request_ids:
        state = RequestState(request_id, request_id, "POST", "/generate", "/generate", None, SGLANG)
        registry.add(state)
    return registry


@pytest.mark.parametrize(
    ("in_flight", "new", "related"),
    [
        (("ab",), "a", "ab"),  # the new ID is a prefix of one in flight
        (("a",), "ab", "a"),  # one in flight is a prefix of the new ID
        (("a", "ab"), "abc", "a"),
        (("ab",), "ab", "ab"),  # the same ID
        (("a_1",), "a_10", "a_1"),  # SGLang's batch items would overlap
        (("ab", "b"), "ac", None),
        (("abc",), "abd", None),
        ((), "a", None),
    ],
)
def test_prefix_related_finds_an_overlapping_id(
    in_flight: tuple[str, ...], new: str, related: str | None
) -> None:
    """An in-flight ID that starts with the new one or that the new one starts with."""
    assert registry_holding(*in_flight).prefix_related(new) == related


def test_prefix_related_ignores_the_requests_own_id() -> None:
    """A request renamed from its minted ID to its body's is not refused for overlapping
    itself, only another's."""
    registry = registry_holding("a3f9", "b")
    assert registry.prefix_related("a3", ignoring="a3f9") is None
    assert registry.prefix_related("b7", ignoring="a3f9") == "b"


def test_a_removed_id_no_longer_overlaps() -> None:
    """The index follows the registry: an ID that ended frees its prefixes."""
    registry = registry_holding("ab", "cd")
    [state] = registry.find("ab")
    registry.remove(state)
    assert registry.prefix_related("a") is None
    assert registry.prefix_related("c") == "cd"


async def test_waiting_for_the_registry_to_empty() -> None:
    """Shutdown's wait: over at once when nothing is in flight; else once the last request
    leaves, for every waiter, a cancelled one leaving the others waiting."""
    registry = Registry()
    await asyncio.wait_for(registry.wait_empty(), 1)  # nothing in flight
    first = RequestState("c1", "i1", "POST", "/generate", "/generate", None, SGLANG)
    second = RequestState("c2", "i2", "POST", "/generate", "/generate", None, SGLANG)
    registry.add(first)
    registry.add(second)
    waiters = [asyncio.create_task(registry.wait_empty()) for _ in range(3)]
    await asyncio.sleep(0)  # (each waiter starts waiting)
    waiters[0].cancel()
    registry.remove(first)
    done, _ = await asyncio.wait(waiters[1:], timeout=0.05)
    assert not done  # one request is still in flight
    registry.remove(second)
    await asyncio.wait_for(asyncio.gather(*waiters[1:]), 1)
    assert waiters[0].cancelled()
    await asyncio.wait_for(registry.wait_empty(), 1)
