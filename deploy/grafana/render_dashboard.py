"""Render the tether dashboard's key panels to a PNG, from a real run.

Grafana is not needed: Prometheus (Debian's `prometheus` package) scrapes a tether running in
front of the bundled fake engine every second while a load generator drives many streams,
about half of whose clients leave at a random moment (FIN or RST, while waiting or mid-stream).
Half-way through, the engine goes away for a few seconds (readiness and upstream errors). Then
the dashboard's own PromQL expressions (deploy/grafana/tether-dashboard.json, Grafana's
variables substituted) are evaluated with Prometheus's query_range API and plotted with
matplotlib, one subplot per time-series panel, titled as in the dashboard. Series tether does
not export (yet) leave a subplot that says so.

    . .venv/bin/activate && pip install matplotlib   # dev-only, not a tether dependency
    apt-get install prometheus                       # Debian 12: /usr/bin/prometheus
    python deploy/grafana/render_dashboard.py        # ~3 min -> deploy/grafana/tether-dashboard.png

`tether` and `tether-fake-engine` are taken from the active venv (next to this Python, else PATH).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DASHBOARD = HERE / "tether-dashboard.json"
PLOTTED_TYPES = ("timeseries", "state-timeline")


# --- processes --------------------------------------------------------------------------------


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def executable(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if not found:
        sys.exit(f"{name} not found: activate tether's venv (or install prometheus for promtool)")
    return found


@dataclass
class Processes:
    """Everything started here, stopped by its process group at the end."""

    logs: Path
    running: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        with open(self.logs / f"{name}.log", "ab") as log:  # the child keeps its own copy
            self.running[name] = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )

    def stop(self, name: str, crash: bool = False) -> None:
        process = self.running.pop(name, None)
        if process is None:
            return
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL if crash else signal.SIGTERM)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def stop_all(self) -> None:
        for name in list(self.running):
            self.stop(name)


@contextmanager
def processes(logs: Path) -> Iterator[Processes]:
    procs = Processes(logs)
    try:
        yield procs
    finally:
        procs.stop_all()


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {url}")
        time.sleep(0.2)


# --- load -------------------------------------------------------------------------------------


@dataclass
class LoadStats:
    requests: int = 0
    completed: int = 0
    left_fin: int = 0
    left_rst: int = 0
    error_responses: int = 0
    errors: int = 0


async def one_request(port: int, rng: random.Random, stats: LoadStats) -> None:
    """One client: a streamed (sometimes non-streamed) completion; about half leave early."""
    max_tokens = rng.randint(20, 160)
    prefill = rng.uniform(0.0, 0.4)
    knobs: dict[str, Any] = {"prefill": prefill}
    if rng.random() < 0.03:
        knobs["fail_after"] = rng.randint(1, max_tokens)  # the engine breaks mid-response
    stream = rng.random() < 0.9
    body = json.dumps(
        {
            "model": "fake",
            "stream": stream,
            "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hello"}],
            "fake": knobs,
        }
    ).encode()
    leave = rng.random() < 0.5
    # Leave while queued / in prefill, or mid-stream (the fake engine sends a token / 20 ms).
    leave_after = rng.uniform(0.0, prefill + max_tokens * 0.02) if leave else math.inf
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: tether\r\nContent-Type: application/json\r\n"
        f"X-Request-Id: load-{rng.getrandbits(48):012x}\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    stats.requests += 1
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        stats.errors += 1
        return
    try:
        writer.write(head + body)
        await writer.drain()
        deadline = time.monotonic() + leave_after
        status = b""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                chunk = await asyncio.wait_for(reader.read(65536), timeout=min(remaining, 30))
            except TimeoutError:
                if math.isinf(leave_after):
                    stats.errors += 1
                    return
                break
            if not chunk:
                if status == b"200":
                    stats.completed += 1
                else:
                    stats.error_responses += 1
                    await asyncio.sleep(rng.uniform(0.5, 1.0))  # clients back off on errors
                return
            if not status and chunk.startswith(b"HTTP/") and b" " in chunk:
                status = chunk.split(b" ", 2)[1]
        # The client leaves: half by closing (FIN), half by resetting (RST).
        if rng.random() < 0.5:
            sock = writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            stats.left_rst += 1
        else:
            stats.left_fin += 1
    except OSError:
        stats.errors += 1
    finally:
        writer.close()


async def drive(port: int, streams: int, seconds: float, seed: int, stats: LoadStats) -> None:
    end = time.monotonic() + seconds

    async def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        await asyncio.sleep(rng.uniform(0, 2))  # ramp up
        while time.monotonic() < end:
            await one_request(port, rng, stats)

    await asyncio.gather(*(client(i) for i in range(streams)))


# --- queries and plots ------------------------------------------------------------------------


def substitute(expr: str, rate_interval: str, range_: str) -> str:
    values = {"__rate_interval": rate_interval, "__interval": "1s", "__range": range_}

    def repl(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, ".*")  # $namespace, $job, $pod: the "All" value

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)


def query_range(
    prometheus: str, expr: str, start: float, end: float, step: float
) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as r:
        answer = json.load(r)
    if answer.get("status") != "success":
        raise RuntimeError(f"{expr}: {answer}")
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def legend(fmt: str, labels: dict[str, str]) -> str:
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt or "").strip()
    return text or ", ".join(f"{k}={v}" for k, v in labels.items() if k != "__name__") or "value"


def render(
    panels: list[dict[str, Any]],
    series: dict[int, list[tuple[str, list[float], list[float]]]],
    t0: float,
    title: str,
    out: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, PercentFormatter

    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(18, 3.6 * rows), squeeze=False)
    fig.suptitle(textwrap.fill(title, 150), fontsize=12, x=0.01, ha="left")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    for ax, panel in zip(axes.flat, panels, strict=False):
        ax.set_title(panel["title"], fontsize=11, loc="left")
        ax.grid(alpha=0.3)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=8)
        lines = series.get(panel["id"], [])
        if not lines:
            ax.text(
                0.5,
                0.5,
                "no data\n(series absent: not exported by this tether, or nothing happened)",
                ha="center",
                va="center",
                transform=ax.transAxes,
                fontsize=9,
                color="gray",
            )
            continue
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        unit = defaults.get("unit", "")
        colors = {
            o["matcher"]["options"]: p["value"]["fixedColor"]
            for o in panel.get("fieldConfig", {}).get("overrides", [])
            for p in o.get("properties", [])
            if o["matcher"].get("id") == "byName" and p.get("id") == "color"
        }
        stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
        if panel["type"] == "state-timeline":
            for i, (name, xs, ys) in enumerate(lines):
                base = i * 1.5
                ax.fill_between(
                    [x - t0 for x in xs],
                    [base + y for y in ys],
                    base,
                    step="post",
                    color="tab:green",
                    alpha=0.6,
                )
                ax.step([x - t0 for x in xs], [base + y for y in ys], where="post", label=name)
            ax.set_yticks([i * 1.5 + 0.5 for i in range(len(lines))], [n for n, _, _ in lines])
            ax.set_ylim(-0.2, len(lines) * 1.5)
            continue
        if stacked:
            grid = sorted({x for _, xs, _ in lines for x in xs})
            stacks = []
            for _, xs, ys in lines:
                values = dict(zip(xs, ys, strict=True))
                stacks.append(
                    [0.0 if math.isnan(values.get(x, 0.0)) else values.get(x, 0.0) for x in grid]
                )
            ax.stackplot(
                [x - t0 for x in grid],
                *stacks,
                labels=[name for name, _, _ in lines],
                colors=[colors.get(name) or f"C{i}" for i, (name, _, _) in enumerate(lines)],
                alpha=0.8,
            )
        else:
            for i, (name, xs, ys) in enumerate(lines):
                ax.plot([x - t0 for x in xs], ys, label=name, color=colors.get(name) or f"C{i}")
        if unit == "percentunit":
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        elif unit == "s":
            ax.yaxis.set_major_formatter(
                FuncFormatter(lambda v, _: f"{v * 1000:.0f} ms" if abs(v) < 1 else f"{v:.1f} s")
            )
        elif unit == "reqps":
            ax.set_ylabel("per second", fontsize=8)
        if defaults.get("min") == 0:
            ax.set_ylim(bottom=0)
        ax.legend(fontsize=7, loc="upper left", ncol=2)
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(out, dpi=90)
    plt.close(fig)


# --- main -------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=150, help="length of the load (150)")
    parser.add_argument("--streams", type=int, default=64, help="concurrent clients (64)")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--rate-interval", default="10s", help="$__rate_interval (10s)")
    parser.add_argument("--out", type=Path, default=HERE / "tether-dashboard.png")
    parser.add_argument("--prometheus", default=shutil.which("prometheus") or "/usr/bin/prometheus")
    parser.add_argument("--no-outage", action="store_true", help="keep the engine up throughout")
    args = parser.parse_args()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        sys.exit("matplotlib is needed (dev only): pip install matplotlib")
    if not Path(args.prometheus).exists():
        sys.exit("prometheus not found: apt-get install prometheus (or --prometheus PATH)")
    tether, fake_engine = executable("tether"), executable("tether-fake-engine")
    dashboard = json.loads(DASHBOARD.read_text())
    panels = [p for p in dashboard["panels"] if p["type"] in PLOTTED_TYPES]

    engine_port, tether_port, admin_port, prom_port = free_ports(4)
    with tempfile.TemporaryDirectory(prefix="tether-render-") as tmp, processes(Path(tmp)) as procs:
        work = Path(tmp)
        (work / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
            "scrape_configs:\n  - job_name: tether\n    static_configs:\n"
            f"      - targets: ['127.0.0.1:{admin_port}']\n"
            # What a PodMonitor would add, so the legends read as in a cluster.
            "        labels: {namespace: demo, pod: llama-0}\n"
        )
        engine_argv = [
            fake_engine,
            "--host",
            "127.0.0.1",
            "--port",
            str(engine_port),
            "--abort-route",
            "dev",
            "--token-interval",
            "0.02",
            "--max-tokens",
            "400",
        ]
        procs.start("engine", engine_argv)
        procs.start(
            "tether",
            [tether],
            {
                "TETHER_UPSTREAM_URL": f"http://127.0.0.1:{engine_port}",
                "TETHER_HOST": "127.0.0.1",
                "TETHER_PORT": str(tether_port),
                "TETHER_ADMIN_HOST": "127.0.0.1",
                "TETHER_ADMIN_PORT": str(admin_port),
                "TETHER_HEALTH_INTERVAL": "0.5",
                "TETHER_LOG_LEVEL": "warning",
            },
        )
        procs.start(
            "prometheus",
            [
                args.prometheus,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
                "--log.level=warn",
            ],
        )
        prometheus = f"http://127.0.0.1:{prom_port}"
        wait_http(f"http://127.0.0.1:{admin_port}/readyz")
        wait_http(f"{prometheus}/-/ready")
        time.sleep(3)  # a few scrapes before the load

        stats = LoadStats()
        start = time.time()
        print(f"load: {args.streams} clients for {args.seconds:.0f} s, about half leaving early")

        async def run() -> None:
            load = asyncio.create_task(
                drive(tether_port, args.streams, args.seconds, args.seed, stats)
            )
            if not args.no_outage:
                await asyncio.sleep(args.seconds * 0.55)
                print("engine outage: killing the fake engine, restarting it 6 s later")
                procs.stop("engine", crash=True)
                await asyncio.sleep(6)
                procs.start("engine", engine_argv)
            await load

        asyncio.run(run())
        time.sleep(4)  # the last scrapes
        end = time.time()
        print(f"load done: {stats}")

        series: dict[int, list[tuple[str, list[float], list[float]]]] = {}
        range_ = f"{int(end - start)}s"
        for panel in panels:
            for target in panel.get("targets", []):
                expr = substitute(target["expr"], args.rate_interval, range_)
                for result in query_range(prometheus, expr, start - 3, end, 1.0):
                    xs = [float(t) for t, _ in result["values"]]
                    ys = [float(v) for _, v in result["values"]]
                    name = legend(target.get("legendFormat", ""), result["metric"])
                    series.setdefault(panel["id"], []).append((name, xs, ys))
            found = len(series.get(panel["id"], []))
            print(f"  {panel['title']}: {found} series" + ("" if found else " (absent)"))
        title = (
            f"tether dashboard, rendered from a real run: {args.streams} concurrent clients for "
            f"{args.seconds:.0f} s in front of the fake engine; {stats.requests} requests, "
            f"{stats.left_fin} clients left with FIN, {stats.left_rst} with RST"
            + ("" if args.no_outage else "; the engine crashed at 55 % and was back 6 s later")
        )
        render(panels, series, start, title, args.out)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
