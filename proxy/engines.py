"""What differs per engine: where tether's request ID goes and how a request is aborted.

Pure: builds descriptions of calls, the upstream client sends them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .settings import Engine, Settings

# vLLM keys a chat request as `chatcmpl-<X-Request-Id>` and a completion as `cmpl-<…>`; an
# abort naming the bare ID matches nothing (observed on 0.32).
_VLLM_ID_PREFIXES = {"/v1/chat/completions": ("chatcmpl-",), "/v1/completions": ("cmpl-",)}
_VLLM_ANY_PREFIX = ("chatcmpl-", "cmpl-")
# Dev-mode/tokens-only route first, then the scale-out one; a default server has neither.
_VLLM_ABORT_PATHS = ("/abort_requests", "/inference/v1/abort_requests")
_SGLANG_ABORT_PATH = "/abort_request"


@dataclass(frozen=True, slots=True)
class AbortCall:
    """One HTTP call that asks the engine to stop a request."""

    method: str
    url: str
    body: bytes | None


class EngineProfile:
    """The engine-specific rules, built once from the settings."""

    def __init__(self, settings: Settings) -> None:
        self.engine = settings.engine
        self._upstream_url = settings.upstream_url
        self._abort_url = settings.abort_url
        self._abort_method = settings.abort_method
        self._abort_body = settings.abort_body

    @property
    def sends_aborts(self) -> bool:
        return self.engine is not Engine.NONE

    def body_fields(self, body_has_request_id: bool, internal_request_id: str) -> dict[str, str]:
        """Top-level JSON fields to set in a request body (the header alone is not enough).

        SGLang takes its rid only from the body. vLLM prefers the header, but a client's own
        `request_id` in the body must not survive either.
        """
        if self.engine is Engine.SGLANG:
            return {"rid": internal_request_id}
        if self.engine is Engine.VLLM and body_has_request_id:
            return {"request_id": internal_request_id}
        return {}

    @property
    def rewrites_json_bodies(self) -> bool:
        return self.engine in (Engine.SGLANG, Engine.VLLM)

    def abort_calls(self, path: str, internal_request_id: str) -> tuple[AbortCall, ...]:
        """Candidate calls, in order: the first the engine supports is the one to use."""
        if self.engine is Engine.NONE:
            return ()
        if self.engine is Engine.VLLM:
            prefixes = _VLLM_ID_PREFIXES.get(path.rstrip("/"), _VLLM_ANY_PREFIX)
            body = json.dumps(
                {"request_ids": [prefix + internal_request_id for prefix in prefixes]}
            ).encode()
            return tuple(
                AbortCall("POST", self._resolve(path), body)
                for path in self._paths(_VLLM_ABORT_PATHS)
            )
        if self.engine is Engine.SGLANG:
            body = json.dumps({"rid": internal_request_id}).encode()
            return tuple(
                AbortCall("POST", self._resolve(path), body)
                for path in self._paths((_SGLANG_ABORT_PATH,))
            )
        assert self._abort_url is not None  # settings require it for generic
        body_text = (
            self._abort_body.format(internal_request_id=internal_request_id)
            if self._abort_body is not None
            else None
        )
        return (
            AbortCall(
                self._abort_method,
                self._resolve(self._abort_url),
                body_text.encode() if body_text is not None else None,
            ),
        )

    def _paths(self, built_in: tuple[str, ...]) -> tuple[str, ...]:
        return (self._abort_url,) if self._abort_url is not None else built_in

    def _resolve(self, url_or_path: str) -> str:
        return self._upstream_url + url_or_path if url_or_path.startswith("/") else url_or_path
