"""The abort call queue, without sockets: calls made at once while the engine keeps up, a
bounded number in flight when it does not, the IDs of waiting stops merged into one call where
the engine's abort takes a list (never past `IDS_PER_CALL`), never where it does not, and every
waiting stop told its call's outcome, a crash included."""

from __future__ import annotations

import asyncio

import pytest

from proxy.aborts.queue import IDS_PER_CALL, CallOutcome, CallQueue, CallResult

from .support.fake_transport import settle

pytestmark = pytest.mark.socket_free

ACCEPTED = CallOutcome(CallResult.ACCEPTED, attempts=1, detail="200")


class Engine:
    """The abort calls as the engine receives them; each is answered when the test says."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []
        self._answers: list[asyncio.Future[CallOutcome]] = []

    async def send(self, ids: tuple[str, ...]) -> CallOutcome:
        self.calls.append(ids)
        answer: asyncio.Future[CallOutcome] = asyncio.get_running_loop().create_future()
        self._answers.append(answer)
        return await answer

    def answer(self, index: int, outcome: CallOutcome = ACCEPTED) -> None:
        self._answers[index].set_result(outcome)

    def fail(self, index: int, error: Exception) -> None:
        self._answers[index].set_exception(error)

    @property
    def in_flight(self) -> int:
        return sum(not answer.done() for answer in self._answers)

    async def finish(self, queue: CallQueue) -> None:
        """Answers every call, those the queue still makes included, until none is left."""
        while self.in_flight:
            for answer in self._answers:
                if not answer.done():
                    answer.set_result(ACCEPTED)
            await settle()
        await asyncio.wait_for(queue.drain(), 1)


async def test_a_call_is_made_at_once_while_the_engine_keeps_up() -> None:
    """A stop whose queue is idle is sent on the loop's next turn, alone, and learns its
    outcome when the engine answers."""
    engine = Engine()
    queue = CallQueue(engine.send, merges=True)
    outcome = queue.call(("a",))
    await settle()
    assert engine.calls == [("a",)]
    assert not outcome.done()
    engine.answer(0)
    assert await asyncio.wait_for(outcome, 1) == ACCEPTED
    await engine.finish(queue)


async def test_waiting_stops_merge_into_one_call_when_the_engine_takes_a_list() -> None:
    """With every slot busy, the stops queued behind go out together in one call once a slot
    frees, and each of them gets that call's outcome."""
    engine = Engine()
    queue = CallQueue(engine.send, merges=True)
    first = [queue.call((f"busy-{n}",)) for n in range(8)]
    await settle()
    assert engine.in_flight == 8
    waiting = [queue.call((f"late-{n}",)) for n in range(5)]
    await settle()
    assert len(engine.calls) == 8  # nothing more until a slot frees
    engine.answer(0)
    await settle()
    assert engine.calls[8] == tuple(f"late-{n}" for n in range(5))
    engine.answer(8, CallOutcome(CallResult.FAILED, attempts=2, detail="503"))
    outcomes = await asyncio.wait_for(asyncio.gather(*waiting), 1)
    assert {outcome.result for outcome in outcomes} == {CallResult.FAILED}
    assert (await asyncio.wait_for(first[0], 1)).result is CallResult.ACCEPTED
    await engine.finish(queue)


async def test_a_merged_call_never_names_more_than_its_bound() -> None:
    """Stops queued beyond `IDS_PER_CALL` IDs wait for the next call: no engine call grows
    with the number of clients that left."""
    engine = Engine()
    queue = CallQueue(engine.send, merges=True)
    for n in range(8):
        queue.call((f"busy-{n}",))
    await settle()
    for n in range(IDS_PER_CALL + 10):
        queue.call((f"late-{n}",))
    engine.answer(0)
    engine.answer(1)
    await settle()
    assert [len(ids) for ids in engine.calls[8:]] == [IDS_PER_CALL, 10]
    await engine.finish(queue)


async def test_an_engine_that_aborts_one_at_a_time_gets_one_call_per_stop() -> None:
    """Where the abort names one request (SGLang, templates), stops are never merged, and at
    most 32 calls are in flight at once."""
    engine = Engine()
    queue = CallQueue(engine.send, merges=False)
    for n in range(40):
        queue.call((f"r{n}",))
    await settle()
    assert engine.in_flight == 32
    assert all(len(ids) == 1 for ids in engine.calls)
    engine.answer(0)
    await settle()
    assert engine.calls[32] == ("r32",)
    assert engine.in_flight == 32
    await engine.finish(queue)


async def test_a_crashed_call_reaches_every_stop_it_named_and_the_queue_goes_on() -> None:
    """A call that raises (a bug in sending it) fails every stop waiting on it, and the next
    stop is still sent."""
    engine = Engine()
    queue = CallQueue(engine.send, merges=True)
    for n in range(8):
        queue.call((f"busy-{n}",))
    await settle()
    merged = [queue.call(("x",)), queue.call(("y",))]
    engine.answer(0)
    await settle()
    engine.fail(8, RuntimeError("bug"))
    for outcome in merged:
        with pytest.raises(RuntimeError, match="bug"):
            await asyncio.wait_for(outcome, 1)
    after = queue.call(("z",))
    await settle()
    assert engine.calls[-1] == ("z",)
    engine.answer(len(engine.calls) - 1)
    assert (await asyncio.wait_for(after, 1)).result is CallResult.ACCEPTED
    await engine.finish(queue)


async def test_drain_returns_once_no_call_is_in_flight() -> None:
    """Shutdown's wait for the aborts ends when the last call was answered, not before."""
    engine = Engine()
    queue = CallQueue(engine.send, merges=True)
    queue.call(("a",))
    await settle()
    drained = asyncio.ensure_future(queue.drain())
    await settle()
    assert not drained.done()
    engine.answer(0)
    await asyncio.wait_for(drained, 1)
