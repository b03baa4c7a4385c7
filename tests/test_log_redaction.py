"""No prompt, completion or credential ever reaches a log line: the redaction step as a table,
then every error path driven with the canary prompt and secret, and the captured output
searched for them."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from proxy.observe.logging import REDACTED, Redactor, render_json
from tether_fake_engine import AbortRoute

from .support.canaries import CANARY_PROMPT, CANARY_SECRET, LEAK_MARKERS
from .support.chat import chat_body
from .support.in_process import TetherFactory, drained, leave_mid_stream, settled, url
from .support.raw_http import RawClient, request_head
from .support.upstreams import FakeEngineFactory, UpstreamAppFactory

REDACTOR = Redactor([CANARY_SECRET])


def redact(**event: object) -> dict[str, object]:
    """What a record's fields become, then its text, as production renders it."""
    fields = REDACTOR(None, "info", dict(event))
    rendered = REDACTOR.masking(render_json)(None, "info", fields)
    assert isinstance(rendered, str)
    loaded: dict[str, object] = json.loads(rendered)
    return loaded


@pytest.mark.socket_free
def test_credential_fields_are_masked_and_content_fields_dropped() -> None:
    """By name, at any depth (a headers dict), whatever the case or spelling."""
    event = redact(
        Authorization=f"Bearer {CANARY_SECRET}",
        headers={"Cookie": "session=1", "X-Api-Key": "k", "Accept": "*/*"},
        body=CANARY_PROMPT,
        messages=[{"content": CANARY_PROMPT}],
        path="/v1/chat/completions",
    )
    assert event == {
        "Authorization": REDACTED,
        "headers": {"Cookie": REDACTED, "X-Api-Key": REDACTED, "Accept": "*/*"},
        "path": "/v1/chat/completions",
    }


@pytest.mark.socket_free
def test_a_record_of_known_plain_fields_is_still_cleaned_when_it_changes() -> None:
    """The redactor learns which field names are plain, so that tether's own lines skip the
    field-by-field look: a record with those names and one more, or a nested value, is still
    cleaned field by field."""
    plain = {"path": "/v1/chat/completions", "status": 200, "error": None}
    assert redact(**plain) == {"path": "/v1/chat/completions", "status": 200}  # None left out
    assert redact(**plain, authorization=f"Bearer {CANARY_SECRET}") == {
        "path": "/v1/chat/completions",
        "status": 200,
        "authorization": REDACTED,
    }
    assert redact(**plain, prompt=CANARY_PROMPT) == {"path": "/v1/chat/completions", "status": 200}
    assert redact(path="/v1/x", status={"cookie": "c", "content": CANARY_PROMPT, "n": None}) == {
        "path": "/v1/x",
        "status": {"cookie": REDACTED, "n": None},  # inside a value, None is data
    }


@pytest.mark.socket_free
def test_secrets_inside_text_are_masked() -> None:
    """Bearer tokens, URL user-info and the configured secrets, wherever a message quotes
    them (an exception's text, a raw protocol line)."""
    event = redact(
        event="Invalid header value char: b'Authorization: Bearer abc.def'",
        detail=f"calling http://admin:hunter2@engine:8000/abort failed: {CANARY_SECRET}",
        exception=[{"exc_value": f"token {CANARY_SECRET} refused"}],
    )
    assert event["event"] == f"Invalid header value char: b'Authorization: Bearer {REDACTED}'"
    assert event["detail"] == f"calling http://{REDACTED}@engine:8000/abort failed: {REDACTED}"
    assert event["exception"] == [{"exc_value": f"token {REDACTED} refused"}]


SHORT = Redactor(["abc"])


@pytest.mark.socket_free
@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("fabcde", "fabcde"),
        ("abcdef", "abcdef"),
        ("x.abc and abc.y and abc-1 and key_abc", "x.abc and abc.y and abc-1 and key_abc"),
        ("Authorization: Bearer abc", f"Authorization: Bearer {REDACTED}"),
        ('{"token": "abc"}', f'{{"token": "{REDACTED}"}}'),
        ("GET /v1/models?key=abc&x=1", f"GET /v1/models?key={REDACTED}&x=1"),
        ("token abc.", f"token {REDACTED}."),
        ("abc", REDACTED),
    ],
)
def test_a_short_secret_is_masked_as_a_whole_value_only(text: str, masked: str) -> None:
    """A short admin token (`abc`) is masked where it stands alone (a bearer token, a JSON
    value, a query parameter, the end of a sentence), never inside a longer word, which it
    would mangle."""
    assert SHORT.mask(text) == masked


def assert_nothing_leaked(output: str) -> None:
    lowered = output.lower()
    for marker in LEAK_MARKERS:
        assert marker.lower() not in lowered, f"{marker} appeared in the log"


async def test_every_error_path_logs_no_prompt_and_no_secret(
    fake_engine: FakeEngineFactory,
    upstream_app: UpstreamAppFactory,
    tether: TetherFactory,
    http: aiohttp.ClientSession,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Completed, abandoned, refused and failed requests, failing aborts with the engine's
    admin key, malformed client heads and broken engine replies: the prompt and the secret
    (sent as the client's bearer token, cookie and the engine's admin key) are in none of
    the lines tether wrote."""
    secret_headers = {"Authorization": f"Bearer {CANARY_SECRET}", "Cookie": CANARY_SECRET}
    engine, engine_url = await fake_engine(token_interval=0.01, abort_route=AbortRoute.SGLANG)
    engine.abort_failures = 3  # the abort path retries, then succeeds
    server = await tether(
        engine_url,
        engine="sglang",
        upstream_admin_key=CANARY_SECRET,
        admin_token=CANARY_SECRET,
        max_json_body=4096,
        abort_timeout=0.2,
        abort_deadline=1.0,
    )
    # Completed, streaming and not.
    for stream in (True, False):
        async with http.post(url(server), json=chat_body(stream), headers=secret_headers) as r:
            await r.read()
    # Abandoned mid-stream: the abort, carrying the admin key, fails three times first.
    await leave_mid_stream(server)
    # Refused: a body that is not JSON where the rid goes, one over the limit, a control route.
    for payload in (CANARY_PROMPT.encode(), (CANARY_PROMPT * 200).encode()):
        headers = {**secret_headers, "Content-Type": "application/json"}
        async with http.post(url(server), data=payload, headers=headers) as r:
            assert r.status in (400, 413)
    async with http.post(url(server, "/abort_request"), json={"rid": CANARY_SECRET}) as r:
        assert r.status == 403
    # A client head aiohttp cannot parse, quoting the secret.
    client = await RawClient.connect(server.port)
    await client.send(
        request_head(headers=[("Authorization", f"Bearer {CANARY_SECRET}\x01")]) + b"\r\n"
    )
    await client.read_until_cut()
    # Admin calls with the secret as a wrong and as the right token.
    for token in (CANARY_SECRET + "-wrong", CANARY_SECRET):
        async with http.post(
            f"http://127.0.0.1:{server.admin_port}/admin/abort",
            json={"request_id": "a-client-id"},
            headers={"Authorization": f"Bearer {token}"},
        ) as r:
            await r.read()
    await settled(server)
    await drained(server)

    # An engine whose broken reply quotes the request (its prompt) back.
    async def broken(request: web.Request) -> web.Response:
        body = await request.read()
        return web.Response(headers={"X-Echo": body[:60].decode("latin-1")}, status=200)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", broken)
    echoing = await tether(await upstream_app(app))
    async with http.post(url(echoing), json=chat_body(), headers=secret_headers) as r:
        await r.read()
    await settled(echoing)

    output = capsys.readouterr().out
    assert '"event": "abort_sent"' in output and '"event": "request_rejected"' in output
    assert_nothing_leaked(output)


@pytest.mark.socket_free
def test_tether_started_line_hides_credentials_in_the_upstream_url() -> None:
    """A URL with user-info (basic auth to an engine behind a proxy) is logged without it."""
    event = redact(event="tether_started", upstream_url="https://user:pass@engine:8000")
    assert event["upstream_url"] == f"https://{REDACTED}@engine:8000"
    assert json.dumps(event).count("pass") == 0
