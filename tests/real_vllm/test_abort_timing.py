"""How long the real vLLM keeps working after clients leave, through tether and without it."""

from __future__ import annotations

import json
import socket
import threading
import time

from ..support.raw_http import request_head
from ..support.real_engine.measurements import Measurements
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    LONG,
    chat,
    on_all,
    on_default_and_dev,
    via_tether,
    vllm_load,
    wait_in_flight,
)

ROUNDS = 8
WIDTH = 4  # streams closed together; the middleware lag shows up with concurrency
PROMPTLY = 1.0  # seconds; vLLM alone needs ~0.03 s
GIVE_UP = 15.0


def _idle_after(stack: Stack, closed_at: float) -> float:
    wait_until(lambda: vllm_load(stack) == 0, GIVE_UP, "vLLM to run nothing")
    return time.monotonic() - closed_at


class _ReadingClient:
    """A client straight to vLLM that reads everything until it closes (as a proxy does)."""

    def __init__(self, port: int) -> None:
        body = json.dumps(chat(LONG, stream=True)).encode()
        self._sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        fields = [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        self._sock.sendall(request_head(CHAT_PATH, headers=fields, host="127.0.0.1") + body)
        self.got_data = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while self._sock.recv(65536):
                self.got_data.set()
        except OSError:
            pass

    def close(self) -> None:
        self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._reader.join(5)


@on_all
def test_mid_stream_disconnects_stop_vllm_promptly(
    stack: Stack, measurements: Measurements
) -> None:
    """Streams dropped together through tether leave vLLM idle within a second, every time."""
    topic = f"timing {stack.vllm.config.name}"
    via: list[float] = []
    for round_ in range(ROUNDS):
        exchanges = [
            via_tether(stack, f"timed-{round_}-{i}", max_tokens=LONG, stream=True)
            for i in range(WIDTH)
        ]
        for index, exchange in enumerate(exchanges):
            assert exchange.read_head() == 200
            exchange.chunks(3)
            wait_in_flight(stack, f"timed-{round_}-{index}")
        closed_at = time.monotonic()
        for exchange in exchanges:
            exchange.close()
        via.append(_idle_after(stack, closed_at))
        measurements.add(topic, f"via tether: {WIDTH} clients close -> vLLM idle (s)", via[-1])
    for _ in range(ROUNDS):  # the engine's own reaction to the same kind of close
        clients = [_ReadingClient(stack.vllm.port) for _ in range(WIDTH)]
        for client in clients:
            assert client.got_data.wait(10)
        wait_until(lambda: vllm_load(stack) == WIDTH, 10, f"vLLM to run {WIDTH} streams")
        closed_at = time.monotonic()
        for client in clients:
            client.close()
        measurements.add(
            topic,
            f"vLLM alone: {WIDTH} reading clients close -> idle (s)",
            _idle_after(stack, closed_at),
        )
    assert max(via) < PROMPTLY, via


def _error_lines(stack: Stack, mark: int) -> list[str]:
    lines = []
    for line in stack.tether.log.text_since(mark).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if entry.get("level") in ("error", "critical"):
            lines.append(line[:300])
    return lines


@on_default_and_dev
def test_client_disconnects_are_not_logged_as_errors(stack: Stack) -> None:
    """Clients that reset their connection mid-stream never make tether log an error.

    Regression guard: before commit 2f758b6 a disconnect noticed by a failed write escaped the
    handler as ClientGoneError and aiohttp logged "Error handling request" with a traceback.
    """
    mark = stack.tether.log.mark()
    rounds, width = 10, 4
    for round_ in range(rounds):
        exchanges = [
            via_tether(stack, f"reset-{round_}-{i}", max_tokens=LONG, stream=True)
            for i in range(width)
        ]
        for exchange in exchanges:
            assert exchange.read_head() == 200
            exchange.chunks(3)
        for exchange in exchanges:
            exchange.reset()
        wait_until(lambda: vllm_load(stack) == 0, GIVE_UP, "vLLM to run nothing")
    wait_until(
        lambda: stack.tether.log.text_since(mark).count('"request_finished"') >= rounds * width,
        5,
        "tether to finish every request",
    )
    assert _error_lines(stack, mark) == []
