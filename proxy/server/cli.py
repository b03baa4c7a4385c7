"""`tether abort <request-id> [--fleet] [--admin-url URL] [--json]`: the operator's abort.

It calls a replica's `POST /admin/abort` (the token from TETHER_ADMIN_TOKEN) and says which
replica held the request. Exit codes: 0 something was aborted, 1 nothing with that ID was in
flight, 2 the call itself failed (unreachable, refused, bad arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any

_DEFAULT_ADMIN_PORT = "9090"
_TIMEOUT_SECONDS = 10.0


def abort_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="tether abort",
        description="Abort every in-flight request with this ID (client or internal), on one "
        "replica or, with --fleet, on every replica its fleet settings name.",
    )
    parser.add_argument("request_id")
    parser.add_argument("--fleet", action="store_true", help="abort on every replica")
    parser.add_argument(
        "--admin-url",
        default=f"http://127.0.0.1:{os.environ.get('TETHER_ADMIN_PORT') or _DEFAULT_ADMIN_PORT}",
        help="the admin port of the replica to ask (default: this host's, TETHER_ADMIN_PORT)",
    )
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    args = parser.parse_args(argv)
    token = os.environ.get("TETHER_ADMIN_TOKEN")
    if not token:
        print("tether abort: set TETHER_ADMIN_TOKEN to the replicas' admin token", file=sys.stderr)
        return 2
    body = json.dumps(
        {"request_id": args.request_id, "scope": "fleet" if args.fleet else "local"}
    ).encode()
    call = urllib.request.Request(
        args.admin_url.rstrip("/") + "/admin/abort",
        data=body,
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(call, timeout=_TIMEOUT_SECONDS) as response:
            answer: dict[str, Any] = json.load(response)
    except urllib.error.HTTPError as exc:
        print(
            f"tether abort: {args.admin_url} answered {exc.code}: {_message(exc)}", file=sys.stderr
        )
        return 2
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"tether abort: cannot reach {args.admin_url}: {exc}", file=sys.stderr)
        return 2
    total = answer.get("aborted_total", len(answer.get("aborted", [])))
    if args.json:
        print(json.dumps(answer, indent=2))
    else:
        print("\n".join(describe(answer, args.admin_url)))
    return 0 if total else 1


def describe(answer: dict[str, Any], admin_url: str) -> list[str]:
    """The answer for a human: which replica held the request, and what each one said."""
    rows = [
        (f"{answer.get('replica')} ({admin_url}, asked)", "ok", answer.get("aborted", []), None)
    ]
    for peer in answer.get("peers", []):
        name = f"{peer['replica']} ({peer['peer']})" if peer.get("replica") else peer["peer"]
        rows.append((name, peer.get("status"), peer.get("aborted", []), peer.get("detail")))
    request_id = answer.get("request_id")
    held = [name for name, status, aborted, _ in rows if status == "ok" and aborted]
    if held:
        lines = [f"aborted {request_id!r} on {', '.join(held)}"]
    else:
        lines = [f"no request {request_id!r} was in flight on any replica asked"]
    for name, status, aborted, detail in rows:
        if status != "ok":
            lines.append(f"  {name}: {status}" + (f" ({detail})" if detail else ""))
        elif aborted:
            lines.append(f"  {name}: aborted {len(aborted)} ({', '.join(aborted)})")
        else:
            lines.append(f"  {name}: nothing in flight with that ID")
    return lines


def _message(error: urllib.error.HTTPError) -> str:
    try:
        payload = json.load(error)
        return str(payload["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return error.reason or ""
