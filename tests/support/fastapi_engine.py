"""An engine on the HTTP stack vLLM and SGLang run (uvicorn + FastAPI), for protocol tests.

`python -m uvicorn tests.support.fastapi_engine:app --http httptools|h11 --port P`. It
answers chat completions with the `X-Client` header it got (so a client can tell its own
answer from another's), has a control route (`/abort_requests`, as vLLM's dev mode does) and
FastAPI's 404 for any other path, which it sends before reading the body and then discards
the body by its length, keeping the connection: the behaviour a proxy must not smuggle a
request into. `GET /_seen` lists every request uvicorn parsed (method, path, X-Client), taken
by a pure-ASGI middleware before routing.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request

_seen: list[dict[str, Any]] = []

app = FastAPI()


@app.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@app.post("/v1/chat/completions")
async def chat(request: Request) -> dict[str, Any]:
    await request.body()
    return {"served": request.headers.get("x-client")}


@app.post("/abort_requests")
async def abort_requests() -> dict[str, Any]:
    return {"status": "aborted", "aborted": 0}


@app.get("/_seen")
async def seen() -> list[dict[str, Any]]:
    return _seen


class _Record:
    def __init__(self, inner: Any) -> None:
        self._inner = inner

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in ("/_seen", "/health"):
            headers = {
                name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]
            }
            # Clients' requests only, not tether's own calls (its identity probes).
            if not headers.get("user-agent", "").startswith("tether/"):
                _seen.append(
                    {
                        "method": scope["method"],
                        "path": scope["path"],
                        "client": headers.get("x-client"),
                        "head_bytes": _head_length(scope),
                    }
                )
        await self._inner(scope, receive, send)


def _head_length(scope: dict[str, Any]) -> int:
    """The length of the request head as a proxy that writes `Name: value` lines sent it."""
    query = scope["query_string"]
    target = scope["raw_path"] + (b"?" + query if query else b"")
    size = len(scope["method"]) + 1 + len(target) + len(" HTTP/1.1\r\n")
    size += sum(len(name) + 2 + len(value) + 2 for name, value in scope["headers"])
    return size + 2


app.add_middleware(_Record)
