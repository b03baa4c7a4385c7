"""Pure path rules: which client paths are engine control routes, which an allowlist lets
through, and which methods and HTTP versions are never forwarded. No I/O."""

from __future__ import annotations

import posixpath
import re
from urllib.parse import unquote

_SLASHES = re.compile(r"/{2,}")
# Only paths with one of these can be spelled differently from what they mean.
_NEEDS_NORMALISING = re.compile(r"[%\\]|//|/\.")


def normalised_path(raw_path: str) -> str:
    """The path as an engine's router might end up reading it, for matching only.

    Percent-decoding is repeated (`%252F` → `%2F` → `/`), backslashes count as slashes, runs of
    slashes collapse, dot segments resolve, case and a trailing slash are ignored: every
    spelling of `/abort_requests` normalises to the same string.
    """
    path = raw_path.partition("?")[0].partition("#")[0]
    if _NEEDS_NORMALISING.search(path) is None:  # the common case, on every request
        return path.lower().rstrip("/") or "/"
    for _ in range(4):
        decoded = unquote(path)
        if decoded == path:
            break
        path = decoded
    path = _SLASHES.sub("/", "/" + path.replace("\\", "/"))
    path = posixpath.normpath(path)
    return path.lower().rstrip("/") or "/"


def is_blocked(raw_path: str, blocked_paths: tuple[str, ...]) -> bool:
    """True when the path reaches one of the engine's control routes (prefix match). (The
    server remembers the verdict per path: `server.context.PathChecks`.)"""
    return normalised_path(raw_path).startswith(blocked_paths)


def is_allowed(raw_path: str, allowed_paths: tuple[str, ...]) -> bool:
    """True when the path is one of `allowed_paths` or lies below one (whole segments:
    `/v1/responses` allows `/v1/responses/<id>`, never `/v1/responses_admin`)."""
    path = normalised_path(raw_path)
    return any(
        path == allowed or path.startswith(allowed + "/") or allowed == "/"
        for allowed in allowed_paths
    )


# A tunnel and a request echo: never an engine's business (nginx answers 405 to both).
REFUSED_METHODS = frozenset({"CONNECT", "TRACE"})
# What tether speaks to clients and forwards: HTTP/1.0 and HTTP/1.1 request lines.
FORWARDED_VERSIONS = frozenset({(1, 0), (1, 1)})
