"""With no TETHER_ENGINE, tether in front of a real vLLM says it is vLLM and serves it as vLLM:
in dev mode a client that leaves is aborted through vLLM's own route, by `chatcmpl-<id>`."""

from __future__ import annotations

import pathlib

from ..support.raw_http import RawExchange
from ..support.real_engine.tether import start_tether
from .processes import Stack
from .scenarios import CHAT_PATH, LONG, chat, on_dev_mode, wait_vllm_idle


@on_dev_mode
def test_with_no_engine_set_vllm_is_identified_and_aborted_by_its_route(
    stack: Stack, log_dir: pathlib.Path
) -> None:
    """TETHER_ENGINE unset: `engine_identified` names vLLM with its version, the metric
    says so, and a stream whose client leaves gets vLLM's abort, confirmed."""
    tether = start_tether(
        stack.vllm.url, log_dir / "tether-engine-unset.log", settings={"TETHER_ENGINE": ""}
    )
    try:
        identified = tether.log.wait_json(0, "engine_identified")
        assert (identified["engine"], identified["profile"]) == ("vllm", "vllm"), identified
        version = identified["version"]
        assert version.startswith("0.")
        labels = {"configured": "auto", "identified": "vllm", "profile": "vllm"}
        assert tether.metrics().value("tether_engine_info", **labels, version=version) == 1

        mark = tether.log.mark()
        exchange = RawExchange(tether.port, CHAT_PATH, chat(LONG, True), {})
        assert exchange.read_head() == 200
        [chunk] = exchange.chunks(1)
        exchange.close()
        wait_vllm_idle(stack)
        sent = tether.log.wait_json(mark, "abort_sent")
        assert sent["result"] == "confirmed", sent
        assert sent["engine_request_ids"] == [f"chatcmpl-{sent['internal_request_id']}"]
        # Without an ID of its own the client is shown the one tether minted for it.
        assert chunk["id"] == f"chatcmpl-{sent['client_request_id']}"
    finally:
        tether.process.stop()
