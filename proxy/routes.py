"""Pure path rules: which client paths are engine control routes. No I/O."""

from __future__ import annotations

import functools
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


@functools.lru_cache(maxsize=1024)
def is_blocked(raw_path: str, blocked_paths: tuple[str, ...]) -> bool:
    """True when the path reaches one of the engine's control routes (prefix match).

    Clients use a handful of paths, so the answer is remembered per path (a bounded cache:
    many distinct paths only cost the normalisation, never memory)."""
    return normalised_path(raw_path).startswith(blocked_paths)
