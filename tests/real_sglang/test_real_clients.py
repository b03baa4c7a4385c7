"""The clients people really use, against tether in front of the real SGLang: the openai SDK
and aiperf's request cancellation."""

from __future__ import annotations

import pathlib
import time

import pytest

from ..support.real_engine.clients import (
    install_aiperf,
    openai_completion,
    openai_stream,
    run_with_cancellations,
)
from ..support.real_engine.measurements import Measurements
from .processes import SglangInstall, Stack
from .scenarios import (
    LONG,
    PROMPTLY,
    aborted_rids,
    aborts,
    finished_rids,
    on_default,
    received_rids,
    sglang_load,
    sglang_metrics,
    wait_abort_logged,
    wait_sglang_idle,
)


@on_default
def test_openai_sdk_stream_closed_early_aborts_in_sglang(
    stack: Stack, measurements: Measurements
) -> None:
    """The openai SDK: break out of a stream after a few chunks and close it; SGLang aborts
    tether's rid at once, and every chunk carried the client's own ID."""
    mark = stack.sglang.log.mark()
    stream, ids = openai_stream(stack.tether, "openai-sdk-stream-1", LONG, chunks=5)
    internal_request_id = stack.tether.wait_in_flight("openai-sdk-stream-1")["internal_request_id"]
    closed_at = time.monotonic()
    stream.close()
    wait_sglang_idle(stack)
    elapsed = time.monotonic() - closed_at
    wait_abort_logged(stack, mark, internal_request_id)
    assert set(ids) == {"openai-sdk-stream-1"}
    assert elapsed < PROMPTLY
    measurements.add("real clients", "openai SDK stream.close() -> SGLang idle (s)", elapsed)


@on_default
def test_openai_sdk_non_streaming_sees_client_id(stack: Stack) -> None:
    """The openai SDK gets its X-Request-Id back in the header and as the completion's ID."""
    raw = openai_completion(stack.tether, "openai-sdk-plain-1", max_tokens=16)
    completion = raw.parse()
    assert raw.headers.get("x-request-id") == "openai-sdk-plain-1"
    assert completion.id == "openai-sdk-plain-1"
    assert completion.usage is not None and completion.usage.completion_tokens == 16


@pytest.fixture(scope="session")
def aiperf() -> pathlib.Path:
    return install_aiperf()


@on_default
@pytest.mark.parametrize("delay", [0.0, 0.3], ids=["cancel-at-send", "cancel-after-0.3s"])
def test_aiperf_cancellations_all_stop_in_sglang(
    stack: Stack,
    aiperf: pathlib.Path,
    engine_install: SglangInstall,
    delay: float,
    tmp_path: pathlib.Path,
    measurements: Measurements,
) -> None:
    """aiperf cancels some requests: tether counts exactly those as disconnects, SGLang aborts
    every one that reached it, finishes all the others, and ends up running nothing."""
    requests = 24
    disconnects_before = stack.tether.metrics().value("tether_client_disconnects_total")
    aborts_before = aborts(stack.tether)
    aborted_before = sglang_metrics(stack).value("sglang:num_aborted_requests_total")
    mark = stack.sglang.log.mark()
    run = run_with_cancellations(
        aiperf, stack.tether.url, engine_install.model, requests, delay, tmp_path / "aiperf"
    )
    wait_sglang_idle(stack, timeout=10)
    disconnects = (
        stack.tether.metrics().value("tether_client_disconnects_total") - disconnects_before
    )
    received = set(received_rids(stack, mark))
    aborted = aborted_rids(stack, mark)
    finished = len(finished_rids(stack, mark, "length"))
    name = f"aiperf delay {delay}s"
    measurements.add(name, "requests sent", len(run.records))
    measurements.add(name, "cancelled by aiperf", run.cancelled)
    measurements.add(name, "tether client disconnects", disconnects)
    measurements.add(name, "tether abort calls (any result)", aborts(stack.tether) - aborts_before)
    measurements.add(name, "SGLang received (tether rids)", len(received))
    measurements.add(name, "SGLang aborted (tether rids)", len(aborted))
    measurements.add(name, "SGLang finished (length)", finished)
    measurements.add(
        name,
        "sglang:num_aborted_requests_total delta",
        sglang_metrics(stack).value("sglang:num_aborted_requests_total") - aborted_before,
    )
    assert len(run.records) == requests and not run.other_errors, run.other_errors[:3]
    assert 0 < run.cancelled < requests
    assert disconnects == run.cancelled
    assert finished == requests - run.cancelled
    assert aborted <= received
    assert len(received) == finished + len(aborted), (
        "a request reached SGLang and neither finished nor aborted"
    )
    if delay > 0:  # every cancelled request had reached SGLang by then
        assert len(aborted) == run.cancelled
    assert sglang_load(stack).running == 0
