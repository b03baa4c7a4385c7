"""Configuration: every bad value stops start-up with exit code 2 naming the variable."""

from __future__ import annotations

import pytest

from proxy.engines import Engine
from proxy.settings import Settings

from .support.canaries import CANARY_SECRET
from .support.collected_log import CollectedLog
from .support.processes import run_tether_cli
from .support.settings import make_settings


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({}, "TETHER_UPSTREAM_URL: is required"),
        ({"TETHER_UPSTREAM_URL": "localhost:8000"}, "TETHER_UPSTREAM_URL"),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_PORT": "eighty"}, "TETHER_PORT"),
        (  # the message names the bad variable, not the secrets set beside it
            {
                "TETHER_UPSTREAM_URL": "http://x",
                "TETHER_ADMIN_TOKEN": CANARY_SECRET,
                "TETHER_UPSTREAM_ADMIN_KEY": CANARY_SECRET,
                "TETHER_PORT": "eighty",
            },
            "TETHER_PORT",
        ),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_PORT": "70000"}, "TETHER_PORT"),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_ENGINE": "tgi"}, "TETHER_ENGINE"),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_CONNECT_TIMEOUT": "-1"},
            "TETHER_CONNECT_TIMEOUT",
        ),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_ENGINE": "generic"}, "TETHER_ABORT_URL"),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_ABORT_BODY": "{rid}"}, "TETHER_ABORT_BODY"),
        (  # an abort call that names no request cannot stop one
            {
                "TETHER_UPSTREAM_URL": "http://x",
                "TETHER_ENGINE": "generic",
                "TETHER_ABORT_URL": "/x",
            },
            "TETHER_ABORT_URL or TETHER_ABORT_BODY must contain {internal_request_id}",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_ABORT_URL": "/abort/{internal_request_id}"},
            "TETHER_ABORT_URL may contain {internal_request_id} only when TETHER_ENGINE=generic",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_ABORT_URL": "/abort/{rid}"},
            "TETHER_ABORT_URL",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_REQUEST_ID_HEADER": "X Bad"},
            "TETHER_REQUEST_ID_HEADER",
        ),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_LOG_LEVEL": "loud"}, "TETHER_LOG_LEVEL"),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_BLOCKED_PATHS": "abort"},
            "TETHER_BLOCKED_PATHS",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_ALLOWED_PATHS": "v1/models"},
            "TETHER_ALLOWED_PATHS",
        ),
        (  # tether has no route table of an engine it does not know
            {
                "TETHER_UPSTREAM_URL": "http://x",
                "TETHER_ENGINE": "none",
                "TETHER_ALLOWED_PATHS": "public",
            },
            "TETHER_ALLOWED_PATHS=public needs TETHER_ENGINE=auto, vllm, sglang or llamacpp",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_BLOCKED_PATHS": "public"},
            "TETHER_BLOCKED_PATHS",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_PORT": "9000", "TETHER_ADMIN_PORT": "9000"},
            "TETHER_ADMIN_PORT",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_MAX_REQUEST_HEAD": "0"},
            "TETHER_MAX_REQUEST_HEAD",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_MAX_STREAMED_UPLOADS": "0"},
            "TETHER_MAX_STREAMED_UPLOADS",
        ),
        (
            {
                "TETHER_UPSTREAM_URL": "http://x",
                "TETHER_RESUME_BUFFER": "2000000",
                "TETHER_RESUME_BUFFER_TOTAL": "1000000",
            },
            "TETHER_RESUME_BUFFER must not exceed TETHER_RESUME_BUFFER_TOTAL",
        ),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_RESUME_GRACE": "0"}, "TETHER_RESUME_GRACE"),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_SSE_KEEPALIVE": "0"}, "TETHER_SSE_KEEPALIVE"),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_SSE_KEEPALIVE": "often"},
            "TETHER_SSE_KEEPALIVE",
        ),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_SSE_KEEPALIVE_SKIP_PATHS": "v1/chat"},
            "TETHER_SSE_KEEPALIVE_SKIP_PATHS",
        ),
        ({"TETHER_UPSTREAM_URL": "http://x", "TETHER_ENGINE_SLOTS": "0"}, "TETHER_ENGINE_SLOTS"),
        (
            {"TETHER_UPSTREAM_URL": "http://x", "TETHER_ENGINE_SLOTS": "many"},
            "TETHER_ENGINE_SLOTS",
        ),
    ],
)
def test_bad_setting_exits_2_naming_the_variable(
    collected_log: CollectedLog, env: dict[str, str], named: str
) -> None:
    """tether refuses to start on a bad value and says which variable to fix."""
    result = run_tether_cli(collected_log, env=env)
    assert result.returncode == 2
    assert named in result.stderr


def test_help_lists_every_variable_with_its_default(collected_log: CollectedLog) -> None:
    """`tether --help` documents every TETHER_* variable."""
    result = run_tether_cli(collected_log, "--help")
    assert result.returncode == 0
    for name, _field in Settings.model_fields.items():
        assert f"TETHER_{name.upper()}" in result.stdout
    assert "X-Request-Id" in result.stdout and "(required)" in result.stdout


@pytest.mark.socket_free
def test_defaults_match_the_documented_ones() -> None:
    """Unset variables take the documented defaults."""
    settings = make_settings(
        port=8080, admin_port=9090, shutdown_grace=30, host="0.0.0.0", admin_host="127.0.0.1"
    )
    assert (settings.port, settings.admin_port, settings.engine) == (8080, 9090, Engine.AUTO)
    assert settings.request_id_header == "X-Request-Id"
    assert settings.connect_timeout == 5
    assert settings.request_timeout is None and settings.stream_idle_timeout is None
    assert settings.blocked_paths is None  # the engine's own list (test_control_routes.py)
    assert settings.allowed_paths is None
    assert settings.sse_keepalive is None and settings.sse_keepalive_skip_paths == ()
    assert settings.engine_slots == "auto"


@pytest.mark.socket_free
def test_engine_slots_are_a_count_auto_or_off() -> None:
    """TETHER_ENGINE_SLOTS: a whole number, or auto and off in any case."""
    assert make_settings(engine_slots=" 3 ").engine_slots == 3
    assert make_settings(engine_slots="OFF").engine_slots == "off"
    assert make_settings(engine_slots="Auto").engine_slots == "auto"


@pytest.mark.socket_free
def test_keepalive_skip_paths_are_read_as_the_allowlist_is() -> None:
    """TETHER_SSE_KEEPALIVE_SKIP_PATHS: comma-separated, spaces and trailing slashes ignored,
    matched in lower case (as `wire.routes` matches paths)."""
    settings = make_settings(sse_keepalive_skip_paths=" /v1/Completions/ , /v1/responses")
    assert settings.sse_keepalive_skip_paths == ("/v1/completions", "/v1/responses")


@pytest.mark.socket_free
def test_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Production reads TETHER_* variables; lists are comma-separated."""
    monkeypatch.setenv("TETHER_UPSTREAM_URL", "http://engine:8000/")
    monkeypatch.setenv("TETHER_ENGINE", "sglang")
    monkeypatch.setenv("TETHER_BLOCKED_PATHS", "/a, /B/")
    monkeypatch.setenv("TETHER_REQUEST_TIMEOUT", "12.5")
    settings = Settings()  # type: ignore[call-arg]
    assert settings.upstream_url == "http://engine:8000"
    assert settings.engine is Engine.SGLANG
    assert settings.blocked_paths == ("/a", "/b")
    assert settings.request_timeout == 12.5


@pytest.mark.socket_free
def test_empty_variables_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty value (as Helm and compose render unset ones) means the default: it never
    empties the block list or configures an empty admin token."""
    monkeypatch.setenv("TETHER_UPSTREAM_URL", "http://engine:8000")
    for name in ("TETHER_BLOCKED_PATHS", "TETHER_ADMIN_TOKEN", "TETHER_REQUEST_TIMEOUT"):
        monkeypatch.setenv(name, "")
    settings = Settings()  # type: ignore[call-arg]
    assert settings.blocked_paths is None
    assert settings.admin_token is None and settings.request_timeout is None


@pytest.mark.socket_free
def test_choices_are_case_insensitive() -> None:
    """`INFO`, `Console` and `VLLM` are accepted like their lower-case names."""
    settings = make_settings(log_level="INFO", log_format="Console", engine="VLLM")
    assert (settings.log_level.value, settings.log_format.value, settings.engine) == (
        "info",
        "console",
        Engine.VLLM,
    )


@pytest.mark.socket_free
@pytest.mark.parametrize("field", ["admin_token", "upstream_admin_key"])
def test_blank_secrets_are_refused(field: str) -> None:
    """A token of blanks is a mistake, not a token."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=field):
        make_settings(**{field: "  "})
