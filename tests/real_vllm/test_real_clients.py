"""The clients people really use, against tether in front of the real vLLM: the openai SDK,
curl with -m, and aiperf's request cancellation."""

from __future__ import annotations

import json
import pathlib
import re
import subprocess

import pytest

from ..support.processes import on_core
from ..support.real_engine.clients import (
    install_aiperf,
    openai_completion,
    openai_stream,
    run_with_cancellations,
)
from ..support.real_engine.measurements import Measurements
from ..support.waiting import wait_until
from .processes import EngineInstall, Stack
from .scenarios import (
    CHAT_PATH,
    LONG,
    chat,
    on_default,
    tether_metrics,
    vllm_load,
    vllm_metrics,
    wait_engine_abort,
    wait_in_flight,
    wait_vllm_idle,
)


@on_default
def test_openai_sdk_stream_closed_early_aborts_in_vllm(
    stack: Stack, measurements: Measurements
) -> None:
    """The openai SDK: break out of a stream after a few chunks, close it, vLLM aborts."""
    mark = stack.vllm.log.mark()
    stream, ids = openai_stream(stack.tether, "openai-sdk-stream-1", LONG, chunks=5)
    internal_request_id = wait_in_flight(stack, "openai-sdk-stream-1")["internal_request_id"]
    stream.close()
    elapsed = wait_vllm_idle(stack)
    wait_engine_abort(stack, mark, internal_request_id)
    assert set(ids) == {"chatcmpl-openai-sdk-stream-1"}
    measurements.add("real clients", "openai SDK stream.close() -> vLLM idle (s)", elapsed)


@on_default
def test_openai_sdk_non_streaming_sees_client_id(stack: Stack) -> None:
    """The openai SDK gets its X-Request-Id back in the header and as chatcmpl-<id>."""
    raw = openai_completion(stack.tether, "openai-sdk-plain-1", max_tokens=16)
    completion = raw.parse()
    assert raw.headers.get("x-request-id") == "openai-sdk-plain-1"
    assert completion.id == "chatcmpl-openai-sdk-plain-1"
    assert completion.usage is not None and completion.usage.completion_tokens == 16


def _curl(
    stack: Stack, client_request_id: str, stream: bool, seconds: float
) -> subprocess.CompletedProcess[str]:
    argv = [
        *on_core(0),
        "curl",
        "-sS",
        "-N",
        "-m",
        str(seconds),
        stack.tether.url + CHAT_PATH,
        "-H",
        "Content-Type: application/json",
        "-H",
        f"X-Request-Id: {client_request_id}",
        "-d",
        json.dumps(chat(LONG, stream)),
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 30)


@on_default
@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "non-streaming"])
def test_curl_max_time_aborts_in_vllm(
    stack: Stack, stream: bool, measurements: Measurements
) -> None:
    """curl -m gives up mid-request; tether counts the disconnect and vLLM aborts."""
    before = tether_metrics(stack).value("tether_client_disconnects_total")
    mark = stack.vllm.log.mark()
    result = _curl(stack, f"curl-{'stream' if stream else 'plain'}-1", stream, seconds=1.0)
    assert result.returncode == 28, result.stderr  # curl's "operation timed out"
    if stream:
        assert '"id":"chatcmpl-curl-stream-1"' in result.stdout.replace(" ", "")
    elapsed = wait_vllm_idle(stack)
    internal = re.findall(
        r"Received request chatcmpl-([0-9a-f]{32}):", stack.vllm.log.text_since(mark)
    )
    assert len(internal) == 1
    wait_engine_abort(stack, mark, internal[0])
    wait_until(
        lambda: tether_metrics(stack).value("tether_client_disconnects_total") == before + 1,
        5,
        "tether to count the disconnect",
    )
    measurements.add(
        "real clients",
        f"curl -m ({'stream' if stream else 'non-stream'}): vLLM idle after exit (s)",
        elapsed,
    )


@pytest.fixture(scope="session")
def aiperf() -> pathlib.Path:
    return install_aiperf()


def _tether_counts(stack: Stack) -> dict[str, float]:
    metrics = tether_metrics(stack)
    return {
        "disconnects": metrics.value("tether_client_disconnects_total"),
        "upstream_cancellations": metrics.value("tether_upstream_cancellations_total"),
        "aborts": metrics.value("tether_aborts_total"),
        "requests": metrics.value("tether_requests_total", route=CHAT_PATH),
    }


@on_default
@pytest.mark.parametrize("delay", [0.0, 0.3], ids=["cancel-at-send", "cancel-after-0.3s"])
def test_aiperf_cancellations_all_reach_vllm(
    stack: Stack,
    aiperf: pathlib.Path,
    engine_install: EngineInstall,
    delay: float,
    tmp_path: pathlib.Path,
    measurements: Measurements,
) -> None:
    """aiperf cancels some requests: tether counts exactly those as disconnects, vLLM aborts
    every one that reached it, finishes all the others, and ends up running nothing."""
    requests = 24
    before = _tether_counts(stack)
    finished_before = vllm_metrics(stack).value(
        "vllm:request_success_total", finished_reason="length"
    )
    mark = stack.vllm.log.mark()
    run = run_with_cancellations(
        aiperf, stack.tether.url, engine_install.model, requests, delay, tmp_path / "aiperf"
    )
    wait_vllm_idle(stack, timeout=10)
    after = _tether_counts(stack)
    delta = {key: after[key] - before[key] for key in after}
    log = stack.vllm.log.text_since(mark)
    received = set(re.findall(r"Received request chatcmpl-([0-9a-f]{32}):", log))
    aborted = set(re.findall(r"Aborted request\(s\) chatcmpl-([0-9a-f]{32})", log))
    finished = (
        vllm_metrics(stack).value("vllm:request_success_total", finished_reason="length")
        - finished_before
    )
    name = f"aiperf delay {delay}s"
    measurements.add(name, "requests sent", len(run.records))
    measurements.add(name, "cancelled by aiperf", run.cancelled)
    measurements.add(name, "tether client disconnects", delta["disconnects"])
    measurements.add(name, "tether upstream cancellations", delta["upstream_cancellations"])
    measurements.add(name, "tether abort calls (any result)", delta["aborts"])
    measurements.add(name, "vLLM received (tether IDs)", len(received))
    measurements.add(name, "vLLM aborted (tether IDs)", len(aborted))
    measurements.add(name, "vLLM finished (length)", finished)
    assert len(run.records) == requests and not run.other_errors, run.other_errors[:3]
    assert 0 < run.cancelled < requests
    assert delta["disconnects"] == run.cancelled
    assert finished == requests - run.cancelled
    assert aborted <= received
    assert len(received) == finished + len(aborted), (
        "a request reached vLLM and neither finished nor aborted"
    )
    if delay > 0:  # every cancelled request had reached vLLM by then
        assert len(aborted) == run.cancelled
        assert delta["upstream_cancellations"] == run.cancelled
        assert delta["aborts"] == run.cancelled  # result not_supported: the default server
    assert delta["requests"] == requests
    assert vllm_load(stack) == 0
