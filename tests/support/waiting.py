"""Bounded waits. A regression must fail a test with a message, never hang the run.

Wait on an event when the code under test offers one (`within`); poll only what has no event
(a process's probe, a count tether keeps without notifying anyone): `poll_until`, or
`wait_until` in the blocking code of the real-engine suites (their clients run in threads).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, cast, overload

T = TypeVar("T")


@overload
async def poll_until(
    condition: Callable[[], Awaitable[T | None]],
    timeout: float,
    *,
    interval: float = ...,
    what: str = ...,
    ignoring: tuple[type[BaseException], ...] = ...,
) -> T: ...


@overload
async def poll_until(
    condition: Callable[[], T | None],
    timeout: float,
    *,
    interval: float = ...,
    what: str = ...,
    ignoring: tuple[type[BaseException], ...] = ...,
) -> T: ...


async def poll_until(
    condition: Callable[[], T | Awaitable[T | None] | None],
    timeout: float,
    *,
    interval: float = 0.01,
    what: str = "",
    ignoring: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `condition` (a function or a coroutine function) every `interval` seconds until it
    returns something truthy, and return that (so a condition may return what it found, or
    None while there is nothing yet). After `timeout` seconds, fail with an
    AssertionError naming `what` (and the last error, if `ignoring` swallowed one).

    Exceptions of the types in `ignoring` count as "not yet" (a server still starting).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            result = condition()
            if inspect.isawaitable(result):
                result = await result
        except ignoring as error:
            last_error = error
        else:
            if result:
                return cast(T, result)
        if loop.time() >= deadline:
            described = what or getattr(condition, "__qualname__", repr(condition))
            detail = f" (last error: {last_error!r})" if last_error is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {described}{detail}")
        await asyncio.sleep(interval)


async def within(awaitable: Awaitable[T], timeout: float, what: str) -> T:
    """`await awaitable`, failing with an AssertionError naming `what` after `timeout` seconds.

    A TimeoutError raised by the awaitable itself propagates unchanged.
    """
    bound = asyncio.timeout(timeout)
    try:
        async with bound:
            return await awaitable
    except TimeoutError:
        if bound.expired():
            raise AssertionError(f"{what}: not done within {timeout} s") from None
        raise


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.005
) -> float:
    """Blocking: call `predicate` every `interval` seconds until it holds; return the seconds
    it took, fail with an AssertionError naming `what` after `timeout`."""
    start = time.monotonic()
    deadline = start + timeout
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}")
        time.sleep(interval)
