"""`python -m proxy.workers.worker`: one of the supervisor's workers, as `supervisor` starts it.

A worker is tether as one process runs it (`server.runner.TetherServer`), seated by the
supervisor: its share of the client port (SO_REUSEPORT, the port the supervisor resolved), its
admin app on a private Unix socket (where the other workers, whose sockets it is handed, ask
it for their callers' cancels), and its index on every log line. It stops gracefully on
SIGTERM, and when its lifeline, a pipe only the supervisor writes to, reads end of file: the
supervisor is gone (even SIGKILLed), and a worker must not outlive it. SIGINT is ignored: a
Ctrl-C reaches the whole process group, and the supervisor alone decides (it sends SIGTERM).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

from ..server.boot import boot
from ..server.runner import TetherServer, WorkerSeat, settle_heap
from ..server.siblings import private_directory_problem
from ..settings import Settings


def main(argv: list[str] | None = None) -> int:
    import uvloop

    parser = argparse.ArgumentParser(prog="python -m proxy.workers.worker")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--admin-socket", required=True)
    parser.add_argument("--lifeline-fd", type=int, required=True)
    parser.add_argument("--caller-key-fd", type=int, required=True)
    parser.add_argument("--sibling-socket", action="append", default=[])
    args = parser.parse_args(argv)
    caller_key = _read_key(args.caller_key_fd)
    # The supervisor validated the same environment; this only fails if it changed.
    settings = boot(f"tether worker {args.index}", worker=args.index)
    if settings is None:
        return 2
    # The other workers are answered on the admin socket without a token: only where its
    # directory keeps everyone else out (`server.siblings`).
    problem = private_directory_problem(os.path.dirname(args.admin_socket))
    if problem is not None:
        print(
            f"tether worker {args.index}: runtime directory not private: {problem}", file=sys.stderr
        )
        return 2
    seat = WorkerSeat(
        args.index, args.port, args.admin_socket, caller_key, tuple(args.sibling_socket)
    )
    uvloop.run(_serve(settings, seat, args.lifeline_fd))
    return 0


def _read_key(fd: int) -> bytes:
    """The caller key the supervisor wrote into the pipe (then closed: end of file follows)."""
    with os.fdopen(fd, "rb") as pipe:
        return pipe.read()


async def _serve(settings: Settings, seat: WorkerSeat, lifeline_fd: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Readable only at end of file: the supervisor never writes to the pipe.
    os.set_blocking(lifeline_fd, False)
    loop.add_reader(lifeline_fd, stop.set)
    server = TetherServer(settings, seat=seat)
    await server.start()
    settle_heap()
    try:
        await stop.wait()
    finally:
        loop.remove_reader(lifeline_fd)
        await server.stop()


if __name__ == "__main__":
    sys.exit(main())
