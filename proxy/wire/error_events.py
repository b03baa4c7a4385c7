"""Pure: an error as the one SSE event of a stream that began before the engine answered (SSE
keep-alive's early commit). No I/O.

Once a client's `200 text/event-stream` is out, an error can only reach it as an event, the way
engines send an error that happens mid-stream (vLLM: `data: {"error": {...}}`), which the
OpenAI SDKs raise as an `APIError`. The event carries the engine's error object where the
engine wrote one: OpenAI's `{"error": {...}}` as it is, the flat `{"object": "error", ...}` of
SGLang (and older vLLM) nested the same way, TGI's `{"error": "...", "error_type": ...}` with
its message kept; anything else becomes a message naming the engine's status.
"""

from __future__ import annotations

import json
from typing import Any

_FLAT_MEMBERS = ("message", "type", "param", "code")


def error_event(document: bytes) -> bytes:
    """An error document on one line (`{"error": {...}}`, as `engine_error` and
    `TetherError.body` write it) as one SSE event."""
    return b"data: " + document + b"\n\n"


def engine_error(status: int, body: bytes) -> bytes:
    """The OpenAI-style error document, on one line, for an engine's answer that was not a
    stream: its own error object where it has one, else one naming its status."""
    return json.dumps(_engine_error(status, body), separators=(",", ":")).encode()


def _engine_error(status: int, body: bytes) -> dict[str, Any]:
    try:
        document = json.loads(body)
    except ValueError:  # not JSON (a proxy's HTML page, text, a cut body)
        document = None
    if isinstance(document, dict):
        error = document.get("error")
        if isinstance(error, dict):
            return {"error": error}
        if document.get("object") == "error" and isinstance(document.get("message"), str):
            return {"error": {name: document.get(name) for name in _FLAT_MEMBERS}}
        if isinstance(error, str) and error:
            kind = document.get("error_type")
            return {
                "error": {
                    "message": error,
                    "type": kind if isinstance(kind, str) else _error_type(status),
                    "code": status,
                }
            }
    return {
        "error": {
            "message": f"the engine answered {status}",
            "type": _error_type(status),
            "code": status,
        }
    }


def _error_type(status: int) -> str:
    """OpenAI's type for a client's error, tether's own for the engine's (`errors.py`)."""
    return "invalid_request_error" if 400 <= status < 500 else "upstream_error"
