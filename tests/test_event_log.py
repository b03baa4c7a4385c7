"""The numbering and holding of a stream's events for a resume (`wire.event_log`), without
sockets: an `id:` line opens every event however the engine's reads split it, a resume gets
every event after the one named, and what is held stays within its bounds."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.wire.event_log import EventLog, HeldBytes

pytestmark = pytest.mark.socket_free

EVENTS = [b'data: {"n":1}\n\n', b'data: {"n":2}\n\n', b"data: [DONE]\n\n"]
NUMBERED = b'id: 1\ndata: {"n":1}\n\nid: 2\ndata: {"n":2}\n\nid: 3\ndata: [DONE]\n\n'


def _log(limit: int = 1 << 20, budget: int = 1 << 30) -> EventLog:
    return EventLog(limit, HeldBytes(budget))


def test_every_event_is_opened_by_its_number() -> None:
    """Three events in one read: each gets `id: n` first, nothing else changes."""
    log = _log()
    assert log.feed(b"".join(EVENTS)) == NUMBERED
    assert log.number == 3


@given(st.lists(st.integers(min_value=1, max_value=len(NUMBERED)), max_size=12))
def test_numbering_does_not_depend_on_how_reads_split_the_stream(cuts: list[int]) -> None:
    """Any split of the engine's bytes (a blank line across two reads included) gives the
    client the same numbered stream."""
    raw = b"".join(EVENTS)
    points = sorted({0, *(cut % len(raw) for cut in cuts), len(raw)})
    log = _log()
    out = b"".join(log.feed(raw[a:b]) for a, b in itertools.pairwise(points))
    assert out == NUMBERED


def test_crlf_events_and_blank_lines_between_events() -> None:
    """CRLF line ends end events too; a stray blank line between events is passed on
    unnumbered."""
    log = _log()
    out = log.feed(b"data: a\r\n\r\n\ndata: b\r\n\r") + log.feed(b"\ndata: c\n\n")
    assert out == b"id: 1\ndata: a\r\n\r\n\nid: 2\ndata: b\r\n\r\nid: 3\ndata: c\n\n"


def test_a_resume_gets_every_event_after_the_one_named_and_the_one_in_progress() -> None:
    """After event 1: events 2 and the half-written 3 from its start; after the last: nothing."""
    log = _log()
    log.feed(EVENTS[0] + EVENTS[1] + b"data: [DO")
    assert log.since(1) == b'id: 2\ndata: {"n":2}\n\nid: 3\ndata: [DO'
    assert log.since(3) == b""
    assert log.since(0) == b'id: 1\ndata: {"n":1}\n\n' + (log.since(1) or b"")


def test_while_the_client_reads_only_half_the_limit_is_kept() -> None:
    """The oldest whole events go past half the limit; a resume from before them is refused
    (None), one from after them works."""
    log = _log(limit=64)
    for _ in range(10):
        log.feed(b"data: 0123456789\n\n")  # 25 bytes numbered
    assert log.held_bytes <= 32
    assert log.dropped_through == 9
    assert log.since(8) is None
    assert log.since(9) == b"id: 10\ndata: 0123456789\n\n"


def test_while_the_client_is_away_nothing_is_dropped_and_the_limit_is_reported() -> None:
    """Held for a resume: events stay, and `over_limit` says when they pass the limit."""
    log = _log(limit=64)
    log.feed(b"data: 0123456789\n\n", drop_oldest=False)
    log.feed(b"data: 0123456789\n\n", drop_oldest=False)
    assert not log.over_limit
    log.feed(b"data: 0123456789\n\n", drop_oldest=False)
    assert log.over_limit
    assert log.since(0) is not None


def test_streams_share_the_process_budget_and_give_it_back() -> None:
    """Two streams hold against one budget; released, the budget is whole again."""
    budget = HeldBytes(100)
    one, two = EventLog(1000, budget), EventLog(1000, budget)
    one.feed(b"data: " + b"x" * 60 + b"\n\n", drop_oldest=False)
    two.feed(b"data: " + b"y" * 60 + b"\n\n", drop_oldest=False)
    assert budget.exceeded and two.over_limit
    one.release()
    two.release()
    assert budget.held == 0
    assert one.since(0) is None
