"""The engine connection as a state machine, driven without sockets: a fake transport in, the
engine's bytes fed by hand (at every split point), and what the exchange heard and whether the
connection may be reused read back. Then the pool and its exchanges under random engine
behaviour (hypothesis): each client gets only its own response's bytes, a connection is reused
only after a response that left it clean, and nothing is sent twice unless that is safe."""

from __future__ import annotations

import ast
import asyncio
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import proxy
from proxy.errors import (
    InternalError,
    TetherError,
    UpstreamBrokenError,
    UpstreamProtocolError,
    UpstreamUnavailableError,
)
from proxy.upstream.connection import (
    TRANSITIONS,
    ConnectionEvent,
    ConnectionState,
    ConnectionStateError,
    ResponseHead,
    UpstreamConnection,
)
from proxy.upstream.exchange import UpstreamExchange
from proxy.upstream.pool import UploadLimit, UpstreamPool

from .support.fake_transport import FakeEngine, FakeTransport, settle

pytestmark = pytest.mark.socket_free


class Heard:
    """What an exchange is told by its connection."""

    def __init__(self) -> None:
        self.events: list[object] = []
        self.body = b""
        self.head: ResponseHead | None = None

    def on_head(self, head: ResponseHead) -> None:
        self.head = head
        self.events.append(("head", head.status))

    def on_end(self) -> None:
        self.events.append("end")

    def on_error(self, error: TetherError) -> None:
        self.events.append(type(error))

    def receive(self, chunk: bytes) -> None:
        self.body += chunk


@dataclass
class Machine:
    connection: UpstreamConnection
    transport: FakeTransport
    heard: Heard
    pooled: list[UpstreamConnection] = field(default_factory=list)


def machine(*, head_only: bool = False) -> Machine:
    pooled: list[UpstreamConnection] = []
    connection = UpstreamConnection(pooled.append, lambda _: None)
    transport = FakeTransport(connection)
    connection.connection_made(transport)  # type: ignore[arg-type]
    heard = Heard()
    connection.begin(heard, heard.receive, head_only=head_only)
    return Machine(connection, transport, heard, pooled)


OK = ("head", 200)


@dataclass(frozen=True)
class Case:
    """What the engine sends for one request, and what must come of it."""

    reply: bytes
    events: tuple[object, ...]
    body: bytes = b""
    reusable: bool = False
    engine_closes: bool = False  # after the reply
    head_only: bool = False
    early: bool = False  # the reply arrives before the whole request was written
    # Bytes follow the response: in a later read than its end they meet a connection already
    # back in the pool, which they then close (in the same read it is never pooled).
    bytes_after: bool = False


CASES = {
    "length": Case(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", (OK, "end"), b"ok", True),
    "chunked": Case(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n3\r\nabc\r\n0\r\n\r\n",
        (OK, "end"),
        b"okabc",
        True,
    ),
    "no-body-204": Case(b"HTTP/1.1 204 No Content\r\n\r\n", (("head", 204), "end"), b"", True),
    "informational-first": Case(
        b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
        (OK, "end"),
        b"ok",
        True,
    ),
    "trailers": Case(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n"
        b"Set-Cookie: someone-elses\r\nContent-Type: text/html\r\n\r\n",
        (OK, "end"),
        b"ok",
    ),
    "connection-close": Case(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", (OK, "end"), b"ok"
    ),
    "http-1.0": Case(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", (OK, "end"), b"ok"),
    "close-delimited": Case(
        b"HTTP/1.1 200 OK\r\n\r\nuntil the end", (OK, "end"), b"until the end", engine_closes=True
    ),
    "leftover-partial-head": Case(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nX-Inj",
        (OK, "end"),
        b"ok",
        bytes_after=True,
    ),
    "leftover-head-with-length": Case(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"  # the response, then a head
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n",
        (OK, "end"),
        b"ok",
        bytes_after=True,
    ),
    "leftover-whole-response": Case(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nnobody",
        (OK, "end"),
        b"ok",
        bytes_after=True,
    ),
    "leftover-garbage": Case(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokxyz", (OK, "end"), b"ok", bytes_after=True
    ),
    "leftover-after-close": Case(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nokmore",
        (OK, "end"),
        b"ok",
        bytes_after=True,
    ),
    "head-request": Case(
        b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n", (OK, "end"), head_only=True
    ),
    "early-answer": Case(
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 2\r\n\r\nno",
        (("head", 404), "end"),
        b"no",
        early=True,
    ),
    "length-cut": Case(
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
        (OK, UpstreamBrokenError),
        b"abc",
        engine_closes=True,
    ),
    "chunked-cut": Case(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n10\r\nabc",
        (OK, UpstreamBrokenError),
        b"okabc",
        engine_closes=True,
    ),
    "two-coding-lines": Case(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n",
        (UpstreamProtocolError,),
    ),
    "chunked-then-gzip": Case(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked, gzip\r\n\r\nok", (UpstreamProtocolError,)
    ),
    "length-and-chunked": Case(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\nok",
        (UpstreamProtocolError,),
    ),
    "two-lengths": Case(
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
        (UpstreamProtocolError,),
    ),
    "unasked-upgrade": Case(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n",
        (UpstreamProtocolError,),
    ),
    "bad-status-line": Case(b"HTTP/1.1 2x0 OK\r\n\r\n", (UpstreamProtocolError,)),
    "closed-inside-head": Case(
        b"HTTP/1.1 200 OK\r\nContent-Le", (UpstreamProtocolError,), engine_closes=True
    ),
    "closed-before-answering": Case(b"", (UpstreamUnavailableError,), engine_closes=True),
}


async def run_case(case: Case, pieces: list[bytes]) -> Machine:
    m = machine(head_only=case.head_only)
    m.connection.write(
        b"POST / HTTP/1.1\r\nContent-Length: 4\r\n\r\n" + (b"" if case.early else b"body")
    )
    if not case.early:
        m.connection.request_written()
    for piece in pieces:
        if m.transport.closed:
            break
        m.connection.data_received(piece)
    if case.engine_closes and not m.transport.closed:
        m.transport.close()
    await settle()
    return m


def check(case: Case, m: Machine, *, split: bool = False) -> None:
    assert tuple(m.heard.events) == case.events
    assert m.heard.body == case.body
    if case.reusable:
        assert m.pooled == [m.connection] and m.connection.state is ConnectionState.DONE_REUSABLE
        assert not m.transport.closed
        return
    assert m.transport.closed and m.connection.state is ConnectionState.CLOSED
    if not (split and case.bytes_after):
        assert m.pooled == []


@pytest.mark.parametrize("name", CASES)
async def test_each_engine_behaviour_ends_as_it_must(name: str) -> None:
    """Per behaviour: what the exchange hears (head, end or the error), the body it gets, and
    whether the connection goes back to the pool; at once, in one read."""
    case = CASES[name]
    check(case, await run_case(case, [case.reply]))


@pytest.mark.parametrize("name", CASES)
async def test_every_split_of_the_reply_ends_the_same(name: str) -> None:
    """The reply cut into two reads at every byte, and into single bytes: the same events,
    body and reuse decision as in one read (nothing depends on where a read ends)."""
    case = CASES[name]
    for cut in range(1, len(case.reply)):
        check(case, await run_case(case, [case.reply[:cut], case.reply[cut:]]), split=True)
    check(case, await run_case(case, [bytes([b]) for b in case.reply]), split=True)


async def test_a_stray_crlf_after_a_body_is_harmless_in_either_read() -> None:
    """In the same read, llhttp consumes a CRLF after a body as the gap before a next message
    (nothing stays buffered: the connection is reused); in a later read it is a byte nobody
    asked for (the connection is closed). Either way the client got its body, once."""
    case = Case(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok\r\n", (OK, "end"), b"ok", True)
    check(case, await run_case(case, [case.reply]))
    m = await run_case(case, [case.reply[:-2], case.reply[-2:]])
    assert tuple(m.heard.events) == (OK, "end") and m.heard.body == b"ok"
    assert m.transport.closed


async def test_trailers_never_reach_the_head() -> None:
    """Trailer fields are dropped: the head the client gets is the one before the body."""
    m = await run_case(CASES["trailers"], [CASES["trailers"].reply])
    assert m.heard.head is not None
    assert list(m.heard.head.headers.items()) == [("Transfer-Encoding", "chunked")]


async def test_an_early_answer_stops_the_sending() -> None:
    """Once the engine answered, nothing more of the request may be written."""
    m = machine()
    m.connection.write(b"POST / HTTP/1.1\r\nContent-Length: 100\r\n\r\nfirst half")
    assert m.connection.sending
    m.connection.data_received(CASES["early-answer"].reply)
    assert not m.connection.sending
    await settle()
    assert m.transport.written.endswith(b"first half")


async def test_bytes_on_an_idle_connection_close_it() -> None:
    """Bytes after the exchange ended (a later read) are nobody's: the pooled connection is
    closed, and no later exchange can get them."""
    m = await run_case(CASES["length"], [CASES["length"].reply])
    m.connection.park(0.0)
    m.connection.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 6\r\n\r\nnobody")
    await settle()
    assert m.transport.closed and m.connection.state is ConnectionState.CLOSED


async def test_a_client_that_left_forbids_reuse() -> None:
    """A response that ends cleanly after its client left still closes the connection."""
    m = machine()
    m.connection.write(b"GET / HTTP/1.1\r\n\r\n")
    m.connection.request_written()
    m.connection.forbid_reuse()
    m.connection.data_received(CASES["length"].reply)
    await settle()
    assert m.pooled == [] and m.transport.closed


# --- the table of moves ------------------------------------------------------------------------


def drawn(
    transitions: dict[tuple[ConnectionState, ConnectionEvent], ConnectionState],
) -> list[str]:
    """The table as the module docstring draws it: one arrow per move, event by event in the
    order of a connection's life; an event every state has a move for is drawn once for all
    the states it takes to the same place ("any other state" beside its exceptions)."""
    width = max(len(str(event)) for event in ConnectionEvent)
    lines = []
    for event in ConnectionEvent:
        moves = {state: after for (state, on), after in transitions.items() if on is event}
        common = None
        if len(moves) == len(ConnectionState):
            targets = list(moves.values())
            common = max(targets, key=targets.count)
        for state, after in moves.items():
            if after is not common:
                lines.append(f"{state:<15} ──{event:─<{width}}─▶ {after}")
        if common is not None:
            everyone = all(after is common for after in moves.values())
            whom = "any state" if everyone else "any other state"
            lines.append(f"{whom:<15} ──{event:─<{width}}─▶ {common}")
    return lines


def test_the_docstring_draws_the_table_of_moves() -> None:
    """The state diagram in the connection's docstring is its table of moves, drawn: it
    cannot drift from the code (redraw it from `drawn(TRANSITIONS)` when the table changes)."""
    drawing = "\n".join("    " + line for line in drawn(TRANSITIONS))
    # From the source: a compiled module keeps no docstring.
    source = Path(proxy.__file__).parent / "upstream" / "connection.py"
    docstring = ast.get_docstring(ast.parse(source.read_text()), clean=False)
    assert docstring is not None
    assert "\n" + drawing + "\n\n" in docstring, "redraw:\n" + drawing


def test_an_event_without_a_move_raises_and_moves_nothing() -> None:
    """An event the table has no move for in the current state is tether's bug: it raises at
    once, and the connection stays where it was."""
    m = machine()
    m.connection.request_written()
    with pytest.raises(ConnectionStateError, match="request_written in state awaiting_head"):
        m.connection.request_written()
    assert m.connection.state is ConnectionState.AWAITING_HEAD
    with pytest.raises(ConnectionStateError):
        m.connection.park(0.0)
    assert m.connection.state is ConnectionState.AWAITING_HEAD


async def test_a_missing_move_met_while_parsing_is_tethers_bug_not_the_engines() -> None:
    """A reply that meets a move the table lacks (a 101 to a handshake tether has not finished
    writing, which tether never does) ends the exchange as an internal error, not as the
    engine's protocol error, and closes the connection."""
    heard = Heard()
    connection = UpstreamConnection(lambda _: None, lambda _: None)
    transport = FakeTransport(connection)
    connection.connection_made(transport)  # type: ignore[arg-type]
    connection.begin(heard, heard.receive, head_only=False, upgrade=True)
    connection.data_received(
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n"
    )
    await settle()
    assert heard.events == [InternalError]
    assert transport.closed and connection.state is ConnectionState.CLOSED


# --- the pool and its exchanges under random engine behaviour -----------------------------------


def _length(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)


def _chunked(body: bytes, trailers: bytes = b"") -> bytes:
    half = len(body) // 2
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(part), part) for part in (body[:half], body[half:]))
    return (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + chunks
        + b"0\r\n"
        + trailers
        + b"\r\n"
    )


@dataclass(frozen=True)
class Reply:
    """How the engine answers one request, built around that request's own body."""

    name: str
    build: Callable[[bytes], bytes]
    clean: bool  # leaves the connection reusable
    complete: bool = True  # the client gets the whole body
    engine_closes: bool = False


REPLIES = [
    Reply("length", _length, clean=True),
    Reply("chunked", _chunked, clean=True),
    Reply("trailers", lambda body: _chunked(body, b"Set-Cookie: other-users\r\n"), clean=False),
    Reply(
        "connection-close",
        lambda body: _length(body).replace(b"OK\r\n", b"OK\r\nConnection: close\r\n", 1),
        clean=False,
    ),
    Reply(
        "leftover-response",
        lambda body: _length(body) + _length(b"LEFTOVER-" + body),
        clean=False,
    ),
    Reply("leftover-head", lambda body: _length(body) + b"HTTP/1.1 200 OK\r\nX-Lef", clean=False),
    Reply(
        "close-delimited",
        lambda body: b"HTTP/1.1 200 OK\r\n\r\n" + body,
        clean=False,
        engine_closes=True,
    ),
    Reply(
        "cut",
        lambda body: b"HTTP/1.1 200 OK\r\nContent-Length: 999\r\n\r\n" + body,
        clean=False,
        complete=False,
        engine_closes=True,
    ),
]


@dataclass(frozen=True)
class Step:
    method: str
    streamed: bool  # the request body arrives in two parts
    early: bool  # the engine answers between them (streamed only)
    stale: bool  # the engine closes a reused connection on this request, answering nothing
    reply: Reply


steps = st.builds(
    Step,
    method=st.sampled_from(["POST", "GET"]),
    streamed=st.booleans(),
    early=st.booleans(),
    stale=st.booleans(),
    reply=st.sampled_from(REPLIES),
)


class Sink:
    def __init__(self) -> None:
        self.received = b""

    def feed(self, chunk: bytes) -> None:
        self.received += chunk


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Loop turns until `condition` holds (the fake transport has no event to wait on)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def _send_and_wait_head(
    exchange: UpstreamExchange, head: bytes, body: bytes | AsyncIterator[bytes]
) -> None:
    """As the handler does: send, then wait for the head (where a resend happens)."""
    await exchange.send(head, body)
    await exchange.wait_head()


async def _run_steps(plan: list[Step], rng: random.Random) -> None:
    engine = FakeEngine()
    pool = UpstreamPool(
        "engine",
        80,
        ssl_context=None,
        connect_timeout=1,
        idle_timeout=60,
        uploads=UploadLimit(len(plan)),
        connector=engine.connect,
    )
    clean_before: dict[int, bool] = {}  # id(transport) → its last exchange left it clean
    for index, step in enumerate(plan):
        head = b"%b /request-%d HTTP/1.1\r\nContent-Length: 12\r\n\r\n" % (
            step.method.encode(),
            index,
        )
        own_body = b"<body of %d>" % index
        release = asyncio.Event()

        async def streamed_body() -> AsyncIterator[bytes]:
            yield b"first-"
            await release.wait()  # noqa: B023 - each step awaits its own event before the next
            yield b"second"

        exchange = UpstreamExchange(pool, step.method, replayable=step.method == "GET")
        body = streamed_body() if step.streamed else b"first-second"
        sending = asyncio.create_task(_send_and_wait_head(exchange, head, body))
        await _until(lambda: bool(engine.carrying(head)), "the request head to go out")  # noqa: B023
        [transport] = engine.carrying(head)
        connection = transport.connection
        # A connection is handed out again only after an exchange that left it clean.
        if connection.reused:
            assert clean_before[id(transport)], "reused after an exchange that did not end cleanly"
        sink = Sink()
        exchange.attach(sink)

        sent_twice = False
        if step.stale and connection.reused:
            transport.close()  # read it, answered nothing
            await settle()
            if step.method == "GET" and not step.streamed:  # safe to send again, and replayable
                await _until(lambda: len(engine.carrying(head)) == 2, "the GET to be sent again")  # noqa: B023
                [transport] = [t for t in engine.carrying(head) if not t.closed]
                connection = transport.connection
                sent_twice = True
            else:
                release.set()
                with pytest.raises(UpstreamUnavailableError):
                    await asyncio.wait_for(sending, 2)
                assert len(engine.carrying(head)) == 1, "a POST the engine may have read, resent"
                continue

        early = step.streamed and step.early
        if step.streamed and not early:
            release.set()
            await _until(lambda: transport.written.endswith(b"second"), "the body's second half")  # noqa: B023
        reply = step.reply.build(own_body)
        cuts = sorted(rng.sample(range(1, len(reply)), k=min(3, len(reply) - 1)))
        for start, end in zip([0, *cuts], [*cuts, len(reply)], strict=True):
            if not transport.closed:
                connection.data_received(reply[start:end])
        if step.reply.engine_closes and not transport.closed:
            transport.close()
        await settle()
        await asyncio.wait({sending}, timeout=2)
        assert sending.done()
        if step.reply.complete:
            sending.result()
        else:  # broke behind its head: the handler may meet it there already
            assert sending.exception() is None or isinstance(sending.exception(), TetherError)
        release.set()
        if early:
            assert not transport.written.endswith(b"second"), "sent on after an early answer"

        await asyncio.wait_for(exchange.wait_ended(), 2)
        # Only this request's own body, never a byte of another response.
        if step.reply.complete:
            assert exchange.complete and sink.received == own_body
        else:
            assert exchange.error is not None and own_body.startswith(sink.received)
        clean_before[id(transport)] = step.reply.clean and not early
        assert (not transport.closed) == clean_before[id(transport)]
        # Sent once (or, for a GET on a stale connection, once more on a new one).
        assert len(engine.carrying(head)) == (2 if sent_twice else 1)
    pool.close()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(steps, min_size=1, max_size=8), st.randoms(use_true_random=False))
def test_the_pool_never_mixes_clients(plan: list[Step], rng: random.Random) -> None:
    """Random sequences of requests (POST and GET, whole and streamed bodies) against an
    engine that answers in every way above, early or not, or drops a reused connection: each
    exchange gets exactly its own response's body (a prefix of it when cut), a connection is
    handed out again only after an exchange that left it clean, and a request is written twice
    only when it is a GET (with a body that can be replayed) the engine dropped unanswered."""
    asyncio.run(_run_steps(plan, rng))
