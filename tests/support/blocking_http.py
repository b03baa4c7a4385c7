"""Plain HTTP calls that block (urllib): for the real-engine suites, whose clients run in
threads, and for waiting until a process they start answers. Every status is returned; only
a connection that fails raises."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def http_get(
    url: str, timeout: float = 5.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """GET `url`; return (status, body) for any status, raise only on connection errors."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def http_post_json(
    url: str, payload: Any, headers: dict[str, str] | None = None, timeout: float = 60.0
) -> tuple[int, dict[str, str], bytes]:
    """POST JSON; return (status, headers, body) for any status."""
    data = json.dumps(payload).encode()
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=all_headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers.items()), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers.items()), error.read()
