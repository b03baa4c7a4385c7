"""`tether` / `python -m proxy`: read settings, configure logging, install uvloop, run."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import TYPE_CHECKING

from . import __version__
from .server.cli import abort_main

if TYPE_CHECKING:
    from .settings import Settings

USAGE = f"""\
usage: tether [--help] [--version]
       tether abort <request-id> [--fleet] [--admin-url URL] [--json]

tether {__version__}: a sidecar in front of an LLM inference server. It aborts requests upstream
when their client disconnects and keeps request IDs unique upstream while clients keep
seeing their own. Configured by environment variables only (a .env file is read too).
`tether abort` asks a running replica (or, with --fleet, every replica) to abort a request.

{{settings}}

Exit codes: 0 after a graceful shutdown (SIGTERM/SIGINT), 2 on a bad setting, 1 when
TETHER_WORKERS > 1 could not start (the client port in use, a worker that failed).
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["abort"]:
        # Before anything heavy is imported: the operator's command starts in a tenth of
        # the time the server needs.
        return abort_main(args[1:])
    return _serve_main(args)


def _serve_main(args: list[str]) -> int:
    import uvloop

    from .server.boot import boot
    from .settings import describe_settings

    if args in (["--help"], ["-h"]):
        print(USAGE.format(settings=describe_settings()))
        return 0
    if args == ["--version"]:
        print(__version__)
        return 0
    if args:
        print(
            f"tether takes no arguments, only TETHER_* environment variables; got {args}\n"
            "run `tether --help` for the list",
            file=sys.stderr,
        )
        return 2
    settings = boot("tether")
    if settings is None:
        return 2
    return uvloop.run(_run(settings))


async def _run(settings: Settings) -> int:
    from .server.runner import serve
    from .workers.cpus import worker_count

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    count = worker_count(settings.workers)
    if count == 1:
        await serve(settings, stop)
        return 0
    from .workers.serve import serve_workers
    from .workers.supervisor import StartupError

    try:
        await serve_workers(settings, count, stop)
    except StartupError as error:
        print(f"tether: could not start: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
