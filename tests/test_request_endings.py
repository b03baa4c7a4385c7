"""Every way a request ends is decided once and reported once: each error has one row in the
status table (the admin port's included), every error answer is built from it, and a request
whose stop at the engine fails is still reported."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest

from proxy import errors
from proxy.engines import Engine, engine_profile
from proxy.errors import ERROR_KINDS, TetherError, error_response
from proxy.faults import ABORT_CONFIRM
from proxy.outcomes import Outcome
from proxy.request.state import RequestState
from tether_fake_engine import GenerationState

from .support.faults import BugAt
from .support.in_process import TetherFactory, admin_url, drained, leave_mid_stream, settled
from .support.settings import make_settings
from .support.upstreams import FakeEngineFactory

VLLM = engine_profile(make_settings(), Engine.VLLM)


def _errors_raised() -> list[type[TetherError]]:
    """Every error class tether raises: the leaves of the hierarchy."""
    found: list[type[TetherError]] = []
    pending: list[type[TetherError]] = [TetherError]
    while pending:
        kind = pending.pop()
        children = kind.__subclasses__()
        pending.extend(children)
        if not children:
            found.append(kind)
    return found


@pytest.mark.socket_free
def test_every_error_has_its_row_in_the_status_table() -> None:
    """An error class added without a status, type, code and level fails here, not as a
    request that finds no row in production; and no row names a class that is not raised."""
    raised = set(_errors_raised())
    assert raised == set(ERROR_KINDS)
    assert all(kind.__module__ == errors.__name__ for kind in raised)


@pytest.mark.socket_free
@pytest.mark.parametrize("kind", sorted(ERROR_KINDS, key=str))
def test_every_error_answer_is_built_from_its_row(kind: type[TetherError]) -> None:
    """Status, OpenAI-style body, the echoed ID, `Retry-After` and the connection's close
    come from the error's row, for every error (the admin's too)."""
    row = ERROR_KINDS[kind]
    try:
        error = kind("what went wrong")
    except TypeError:
        error = kind()  # type: ignore[call-arg]  # errors with a fixed message
    response = error_response(error, "X-Request-Id", "client-1")
    assert response.status == row.status
    assert response.content_type == "application/json"
    assert response.body is not None
    body = json.loads(bytes(response.body))  # type: ignore[arg-type]
    assert body["error"] == {"message": error.message, "type": row.error_type, "code": row.code}
    assert response.headers["X-Request-Id"] == "client-1"
    retry_after = None if row.retry_after is None else str(row.retry_after)
    assert response.headers.get("Retry-After") == retry_after
    assert response.keep_alive is (False if row.closes_connection else None)


@pytest.mark.socket_free
async def test_stopping_from_outside_ends_a_request_once() -> None:
    """`RequestState.stop` cancels the handler with the reason it will be reported as, and
    says so only for a request not already ending."""
    handler = asyncio.ensure_future(asyncio.sleep(30))
    state = RequestState(
        "c", "i", "POST", "/v1/chat/completions", "/v1/chat/completions", None, VLLM
    )
    state.task = handler

    assert state.stop(Outcome.ADMIN_ABORTED) is True
    with pytest.raises(asyncio.CancelledError):
        await handler
    assert state.stopped_by is Outcome.ADMIN_ABORTED
    assert state.stop(Outcome.SHUTDOWN_ABORTED) is False
    assert state.stopped_by is Outcome.ADMIN_ABORTED


def _lines(output: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


async def test_a_stop_that_crashes_still_reports_its_request(
    fake_engine: FakeEngineFactory,
    tether: TetherFactory,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A bug in the abort tracker's confirm step is one `abort_crashed` error line, and the
    request it was stopping still gets its one `request_finished` line; the engine's work
    stops all the same (the call went out, the connection is dropped)."""
    engine, engine_url = await fake_engine(token_interval=0.01)
    server = await tether(engine_url, faults=BugAt(ABORT_CONFIRM))
    await leave_mid_stream(server, headers={"X-Request-Id": "crash"})
    await settled(server)
    await drained(server)

    [generation] = engine.generations.values()
    await engine.wait_for(lambda: generation.state is GenerationState.ABORTED)
    lines = _lines(capsys.readouterr().out)
    assert [line["event"] for line in lines if line.get("level") == "error"] == ["abort_crashed"]
    [finished] = [line for line in lines if line["event"] == "request_finished"]
    assert (finished["client_request_id"], finished["outcome"]) == ("crash", "client_disconnected")


async def test_an_admin_error_is_an_openai_style_answer(
    tether: TetherFactory, fake_engine: FakeEngineFactory, http: aiohttp.ClientSession
) -> None:
    """The admin port answers its own errors from the same table: the listing without the
    admin API enabled is 403 `admin_disabled` in the OpenAI error shape."""
    _, engine_url = await fake_engine()
    server = await tether(engine_url)
    async with http.get(admin_url(server, "/admin/requests")) as response:
        assert response.status == 403
        assert (await response.json())["error"] == {
            "message": "the admin API is disabled; set TETHER_ADMIN_TOKEN to enable it",
            "type": "permission_error",
            "code": "admin_disabled",
        }
