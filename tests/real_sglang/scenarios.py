"""Steps the tests share: requests to SGLang's generating routes, and reading SGLang's own
evidence (`/v1/loads`, `/metrics`, its debug and request log) and tether's (admin port, log)."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from ..support.blocking_http import http_get
from ..support.metrics import MetricsSnapshot, scrape
from ..support.raw_http import RawExchange
from ..support.real_engine.stacks import MODEL_NAME
from ..support.real_engine.tether import Tether
from ..support.waiting import wait_until
from .processes import ADMIN_KEY, DEFAULT, WITH_API_KEY, Stack

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
GENERATE_PATH = "/generate"
INTERNAL_ID = re.compile(r"^[0-9a-f]{32}$")
# Tokens: long enough that nothing finishes on its own during a test (~10 s alone on its
# core); the prompt plus this stays inside the 2048-token context.
LONG = 1800
# Seconds from a client's close to SGLang running nothing, through tether. Holds on a
# loaded 2-core machine (observed 0.02-0.07 s; 0.44 s at load average 9) yet catches a
# missed abort: SGLang alone needs ~4 s in every phase it only polls for (non-streaming,
# queued, prefill).
PROMPTLY = 1.0
# Seconds SGLang may take on its own (its 4 s poll, plus a loaded machine).
GIVE_UP = 15.0
# SGLang's scheduler, at `--log-level debug`, for each place it can abort from: `queued`,
# `running`, `chunked prefill` (a request in chunked prefill gets a `running` line too).
ABORT_LINE = r"Abort {kind} request\. req\.rid='{rid}'"
ANY_KIND = "(?:queued|running|chunked prefill)"

on_default = pytest.mark.parametrize("stack", [DEFAULT.name], indirect=True)
on_admin_key = pytest.mark.parametrize("stack", [ADMIN_KEY.name], indirect=True)
on_api_key = pytest.mark.parametrize("stack", [WITH_API_KEY.name], indirect=True)


def chat(max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    """A chat request that generates exactly `max_tokens` tokens (the tiny model never stops)."""
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }


def completion(
    max_tokens: int, stream: bool, prompt: str | list[int] = "Once upon a time", **extra: Any
) -> dict[str, Any]:
    """A completions request; `prompt` may be token IDs (an exact, uncached prompt length)."""
    return {
        "model": MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
        **extra,
    }


def generate(max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    """A native `/generate` request."""
    return {
        "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True},
        "stream": stream,
        **extra,
    }


def request_for(path: str, max_tokens: int, stream: bool, **extra: Any) -> dict[str, Any]:
    builders = {CHAT_PATH: chat, COMPLETIONS_PATH: completion, GENERATE_PATH: generate}
    return builders[path](max_tokens, stream, **extra)


def response_id(chunk: dict[str, Any]) -> str:
    """The request ID a response (or one chunk of it) names: `id`, or `meta_info.id` on
    `/generate`."""
    if "meta_info" in chunk:
        return str(chunk["meta_info"]["id"])
    return str(chunk["id"])


def via_tether(
    stack: Stack,
    client_request_id: str,
    path: str,
    payload: dict[str, Any],
    tether: Tether | None = None,
    content_type: str | None = "application/json",
) -> RawExchange:
    """`payload` sent through tether (`tether`, or the stack's) as `client_request_id`."""
    front = tether or stack.tether
    headers = {"X-Request-Id": client_request_id, **stack.sglang.client_headers}
    return RawExchange(front.port, path, payload, headers, content_type=content_type)


def direct(
    stack: Stack, path: str, payload: dict[str, Any], content_type: str | None = "application/json"
) -> RawExchange:
    """`payload` sent straight to SGLang by the same raw client."""
    headers = dict(stack.sglang.client_headers)
    return RawExchange(stack.sglang.port, path, payload, headers, content_type=content_type)


@dataclass(frozen=True)
class Load:
    """SGLang's `/v1/loads`: what its scheduler held at its last decode step (the suite runs
    it with `--load-snapshot-publish-interval 1`)."""

    running: int
    waiting: int
    # KV cache in use by live requests; the only sign of a request in chunked prefill
    # (it counts as neither running nor waiting then).
    used_tokens: int

    @property
    def idle(self) -> bool:
        return self.running == self.waiting == self.used_tokens == 0


def sglang_load(stack: Stack) -> Load:
    status, body = http_get(stack.sglang.url + "/v1/loads", headers=stack.sglang.client_headers)
    assert status == 200, f"GET /v1/loads answered {status}: {body[:200]!r}"
    (load,) = json.loads(body)["loads"]
    return Load(load["num_running_reqs"], load["num_waiting_reqs"], load["num_used_tokens"])


def wait_load(
    stack: Stack, what: str, check: Callable[[Load], bool], timeout: float = 10.0
) -> float:
    """Poll `/v1/loads` until `check(load)` holds; the seconds it took. A poll SGLang leaves
    unanswered past its own timeout (a starved core) counts as not yet; `timeout` still
    bounds the whole wait."""

    def holds() -> bool:
        try:
            return check(sglang_load(stack))
        except TimeoutError:
            return False

    return wait_until(holds, timeout, what, interval=0.01)


def wait_sglang_idle(stack: Stack, timeout: float = GIVE_UP) -> float:
    return wait_load(stack, "SGLang to run nothing", lambda load: load.idle, timeout)


def sglang_metrics(stack: Stack) -> MetricsSnapshot:
    return scrape(stack.sglang.url + "/metrics")


def abort_directly(stack: Stack, rid: str) -> int:
    """SGLang's own `POST /abort_request`, as only tether may call it; the status."""
    key = stack.sglang.config.abort_key
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        stack.sglang.url + "/abort_request",
        data=json.dumps({"rid": rid}).encode(),
        headers=headers,
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return int(response.status)


def wait_abort_logged(
    stack: Stack, mark: int, rid: str, kind: str = ANY_KIND, timeout: float = 5.0
) -> str:
    """SGLang's debug line for aborting `rid` (exactly that rid) from `kind`, once written
    after `mark`."""
    pattern = ABORT_LINE.format(kind=kind, rid=re.escape(rid))
    return stack.sglang.log.wait_for(mark, pattern, timeout).group(0)


def aborted_rids(stack: Stack, mark: int) -> set[str]:
    """Every rid SGLang's scheduler logged as aborted after `mark`."""
    pattern = ABORT_LINE.format(kind=ANY_KIND, rid="(.*?)")
    return {m.group(1) for m in stack.sglang.log.find_since(mark, pattern)}


def received_rids(stack: Stack, mark: int) -> list[str]:
    """The rids of client requests SGLang received after `mark` (`--log-requests`), in order;
    its own health-check requests left out."""
    found = stack.sglang.log.find_since(mark, r"Receive: obj=\w+\(rid='([^']*)'")
    return [m.group(1) for m in found if not m.group(1).startswith("HEALTH_CHECK")]


def finished_rids(stack: Stack, mark: int, reason: str) -> list[str]:
    """The rids of client requests SGLang finished with `reason` (`length`, `abort`, ...)
    after `mark` (`--log-requests`); its own health-check requests left out."""
    pattern = rf"Finish: obj=\w+\(rid='([^']*)'.*'finish_reason': {{'type': '{reason}'"
    found = stack.sglang.log.find_since(mark, pattern)
    return [m.group(1) for m in found if not m.group(1).startswith("HEALTH_CHECK")]


def tether_events(tether: Tether, mark: int, event: str) -> list[dict[str, Any]]:
    """tether's JSON log entries called `event`, written after `mark`."""
    return tether.log.json_lines(mark, event)


def internal_id_of(tether: Tether, mark: int, client_request_id: str) -> list[str]:
    """The internal IDs tether's `request_finished` lines give `client_request_id`."""
    return [
        str(entry["internal_request_id"])
        for entry in tether_events(tether, mark, "request_finished")
        if entry.get("client_request_id") == client_request_id
    ]


def aborts(tether: Tether, result: str | None = None) -> float:
    """tether's count of abort calls to SGLang (with `result`, or all of them)."""
    labels = {"engine": "sglang", **({"result": result} if result else {})}
    return tether.metrics().value("tether_aborts_total", **labels)


class Occupant:
    """A long stream straight to SGLang that holds its only slot (the one-slot config), so the
    next request waits in its queue; aborted through SGLang's own API on exit."""

    def __init__(self, stack: Stack, rid: str) -> None:
        self._stack = stack
        self.rid = rid

    def __enter__(self) -> Occupant:
        self._exchange = direct(self._stack, CHAT_PATH, chat(LONG, stream=True, rid=self.rid))
        assert self._exchange.read_head() == 200
        self._exchange.chunks(2)
        wait_load(self._stack, "the occupant to run", lambda load: load.running == 1)
        return self

    def __exit__(self, *exc: object) -> None:
        abort_directly(self._stack, self.rid)
        self._exchange.close()
        wait_sglang_idle(self._stack)
