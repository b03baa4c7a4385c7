"""SGLang aborts by rid prefix; tether's fixed-length rids keep one client's abort from ever
reaching another's request."""

from __future__ import annotations

import json
from typing import Any

import pytest

from ..support.real_engine.stacks import MODEL_NAME
from ..support.waiting import wait_until
from .processes import Stack
from .scenarios import (
    CHAT_PATH,
    GIVE_UP,
    LONG,
    abort_directly,
    aborted_rids,
    chat,
    direct,
    on_default,
    tether_events,
    via_tether,
    wait_abort_logged,
    wait_load,
    wait_sglang_idle,
)


def _finish_reasons(events: list[str]) -> list[str]:
    return [
        choice["finish_reason"]
        for event in events
        if event != "[DONE]"
        for choice in json.loads(event)["choices"]
        if choice.get("finish_reason")
    ]


@on_default
def test_prefix_client_id_never_aborts_the_longer_one(stack: Stack) -> None:
    """Client IDs (and body rids) "job-1" and "job-10" in flight together through tether: the
    first client leaving aborts only its own request, the other runs to its end."""
    mark = stack.sglang.log.mark()
    keeper = via_tether(stack, "job-10", CHAT_PATH, chat(300, stream=True, rid="job-10"))
    leaver = via_tether(stack, "job-1", CHAT_PATH, chat(LONG, stream=True, rid="job-1"))
    with keeper, leaver:
        assert keeper.read_head() == 200 and leaver.read_head() == 200
        keeper.chunks(3), leaver.chunks(3)  # both running
        leaver_rid = stack.tether.wait_in_flight("job-1")["internal_request_id"]
        keeper_rid = stack.tether.wait_in_flight("job-10")["internal_request_id"]
        leaver.close()
        wait_abort_logged(stack, mark, leaver_rid)
        rest = list(keeper.events())
    assert rest[-1] == "[DONE]" and _finish_reasons(rest) == ["length"]
    assert keeper_rid != leaver_rid
    assert aborted_rids(stack, mark) == {leaver_rid}


@on_default
def test_sglang_alone_aborts_every_rid_the_prefix_matches(stack: Stack) -> None:
    """Straight to SGLang, aborting rid "job-1" also aborts "job-10" (its scheduler matches
    with startswith): the accident tether's fixed-length rids rule out."""
    mark = stack.sglang.log.mark()
    longer = direct(stack, CHAT_PATH, chat(LONG, stream=True, rid="job-10"))
    shorter = direct(stack, CHAT_PATH, chat(LONG, stream=True, rid="job-1"))
    with longer, shorter:
        assert longer.read_head() == 200 and shorter.read_head() == 200
        longer.chunks(3), shorter.chunks(3)
        assert abort_directly(stack, "job-1") == 200
        ends = [_finish_reasons(list(exchange.events())) for exchange in (longer, shorter)]
    assert ends == [["abort"], ["abort"]]
    assert aborted_rids(stack, mark) == {"job-1", "job-10"}
    wait_sglang_idle(stack)


def _with_chosen_rid(path: str, rid: str) -> dict[str, Any]:
    if path == "/v1/responses":
        return {
            "model": MODEL_NAME,
            "input": "Tell me a long story.",
            "max_output_tokens": LONG,
            "stream": True,
            "request_id": rid,
        }
    # A one-element rid list: SGLang uses it as it is (a bare string would become `<rid>_0`).
    sampling = {"max_new_tokens": LONG, "ignore_eos": True}
    return {
        "instances": [{"text": "Tell me a long story."}],
        "parameters": {"rid": [rid], "sampling_params": sampling},
    }


# Observed 2026-12-01 before tether owned these fields: a client naming the 4-character prefix
# of another request's rid and leaving had SGLang abort that other request too.
@on_default
@pytest.mark.parametrize("path", ["/v1/responses", "/vertex_generate"])
def test_client_chosen_rid_never_aborts_other_clients(stack: Stack, path: str) -> None:
    """SGLang takes the rid of /v1/responses from `request_id` and of /vertex_generate from
    `parameters.rid`: tether writes its own there too, so a client that puts another
    request's rid prefix there and leaves aborts only its own request, at once (Vertex's
    instances are a batch: SGLang runs them as `<rid>_<index>`, and tether names those)."""
    wait_sglang_idle(stack)  # no abort of an earlier test's request still on its way
    mark, tether_mark = stack.sglang.log.mark(), stack.tether.log.mark()
    with via_tether(stack, "bystander", CHAT_PATH, chat(LONG, stream=True)) as bystander:
        assert bystander.read_head() == 200
        bystander.chunks(3)
        bystander_rid = stack.tether.wait_in_flight("bystander")["internal_request_id"]
        prefix = bystander_rid[:4]
        leaver = via_tether(stack, "chooses-its-rid", path, _with_chosen_rid(path, prefix))
        wait_load(stack, "both requests to run", lambda load: load.running >= 2)
        leaver_rid = stack.tether.wait_in_flight("chooses-its-rid")["internal_request_id"]
        leaver.close()
        # tether's abort names the leaver's own rid (`resp_<rid>` on the Responses API).
        wait_until(
            lambda: any(leaver_rid in rid for rid in aborted_rids(stack, mark)),
            GIVE_UP,
            "SGLang to abort the leaver",
        )
        more = bystander.chunks(5)  # an aborted stream would end here, finish_reason "abort"
        aborted = aborted_rids(stack, mark)
    assert [c["choices"][0]["finish_reason"] for c in more] == [None] * 5
    assert bystander_rid not in aborted and prefix not in aborted
    assert all(leaver_rid in rid for rid in aborted)

    # By tether's abort, not SGLang's own 4 s poll of the dropped connection.
    def sent() -> list[dict[str, Any]]:
        return [
            entry
            for entry in tether_events(stack.tether, tether_mark, "abort_sent")
            if entry.get("client_request_id") == "chooses-its-rid"
        ]

    wait_until(lambda: bool(sent()), 5, "tether's abort_sent line")
    assert [entry["result"] for entry in sent()] == ["confirmed"], sent()
