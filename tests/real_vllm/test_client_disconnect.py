"""A client that leaves at any point stops the work in the real vLLM, with and without an
abort route (the default server also runs a user `--middleware`)."""

from __future__ import annotations

from ..support.real_engine.measurements import Measurements
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    LONG,
    Saturation,
    on_all,
    tether_metrics,
    via_tether,
    vllm_load,
    vllm_metrics,
    wait_engine_abort,
    wait_in_flight,
    wait_vllm_idle,
)


def _disconnects(stack: Stack, phase: str | None = None) -> float:
    labels = {"phase": phase} if phase else {}
    return tether_metrics(stack).value("tether_client_disconnects_total", **labels)


@on_all
def test_disconnect_while_queued_aborts_in_vllm(stack: Stack, measurements: Measurements) -> None:
    """A client that leaves while its request waits in vLLM's queue (no token yet) is aborted."""
    before = _disconnects(stack)
    with Saturation(stack):
        mark = stack.vllm.log.mark()
        exchange = via_tether(stack, "leaves-while-queued", max_tokens=LONG, stream=True)
        entry = wait_in_flight(stack, "leaves-while-queued")
        wait_until(
            lambda: vllm_metrics(stack).value("vllm:num_requests_waiting") == 1,
            10,
            "a queued request",
        )
        exchange.close()
        elapsed = wait_until(
            lambda: vllm_metrics(stack).value("vllm:num_requests_waiting") == 0,
            5,
            "the queue to empty",
        )
        wait_engine_abort(stack, mark, entry["internal_request_id"])
    measurements.add(
        f"disconnect {stack.vllm.config.name}",
        "queued: client close -> vLLM queue empty (s)",
        elapsed,
    )
    assert _disconnects(stack) == before + 1


@on_all
def test_disconnect_mid_stream_aborts_in_vllm(stack: Stack, measurements: Measurements) -> None:
    """A client that leaves after some streamed tokens is aborted in vLLM within a moment."""
    before = _disconnects(stack, "streaming")
    mark = stack.vllm.log.mark()
    exchange = via_tether(stack, "leaves-mid-stream", max_tokens=LONG, stream=True)
    assert exchange.read_head() == 200
    assert len(exchange.chunks(20)) == 20
    entry = wait_in_flight(stack, "leaves-mid-stream")
    assert vllm_load(stack) == 1
    exchange.close()
    elapsed = wait_vllm_idle(stack)
    wait_engine_abort(stack, mark, entry["internal_request_id"])
    measurements.add(
        f"disconnect {stack.vllm.config.name}", "mid-stream: client close -> vLLM idle (s)", elapsed
    )
    assert _disconnects(stack, "streaming") == before + 1


@on_all
def test_disconnect_during_non_streaming_aborts_in_vllm(
    stack: Stack, measurements: Measurements
) -> None:
    """A client that leaves a non-streaming request while vLLM generates is aborted."""
    before = _disconnects(stack, "waiting")
    mark = stack.vllm.log.mark()
    exchange = via_tether(stack, "leaves-non-streaming", max_tokens=LONG, stream=False)
    entry = wait_in_flight(stack, "leaves-non-streaming")
    wait_until(lambda: vllm_load(stack) == 1, 10, "vLLM to run the request")
    exchange.close()
    elapsed = wait_vllm_idle(stack)
    wait_engine_abort(stack, mark, entry["internal_request_id"])
    measurements.add(
        f"disconnect {stack.vllm.config.name}",
        "non-streaming: client close -> vLLM idle (s)",
        elapsed,
    )
    assert _disconnects(stack, "waiting") == before + 1
