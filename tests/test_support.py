"""The test toolkit itself: its reads cannot pass on a typo, its waits end, and the canary
grep finds what it is there to find (and only in what tether wrote)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .support.canaries import CANARY_PROMPT, CANARY_SECRET, LEAK_MARKERS, canary_bytes
from .support.collected_log import IN_PROCESS, UPSTREAM, CollectedLog, subprocess_source
from .support.leak_check import find_leaks, main
from .support.metrics import histogram_quantile, metric, metric_in_text, parse_metrics
from .support.waiting import poll_until, wait_until, within

pytestmark = pytest.mark.socket_free


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    aborts = Counter("t_aborts", "Aborts.", ["engine", "result"], registry=registry)
    aborts.labels("vllm", "ok").inc(3)
    Counter("t_unused", "Never incremented.", ["phase"], registry=registry)
    Gauge("t_in_flight", "In flight.", registry=registry).set(2)
    return registry


def test_metric_reads_a_sample_by_its_exposition_name_and_labels() -> None:
    """`name_total{labels}` as /metrics shows it; unseen label values read as 0."""
    registry = _registry()
    assert metric(registry, "t_aborts_total", engine="vllm", result="ok") == 3
    assert metric(registry, "t_aborts_total", engine="vllm", result="failed") == 0
    assert metric(registry, "t_unused_total", phase="body") == 0
    assert metric(registry, "t_in_flight") == 2


def test_metric_refuses_unknown_names_and_partial_labels() -> None:
    """A typo in a name or a missing label raises instead of reading as 0."""
    registry = _registry()
    with pytest.raises(KeyError, match="t_abort_total"):
        metric(registry, "t_abort_total", engine="vllm", result="ok")
    with pytest.raises(KeyError):
        metric(registry, "t_aborts", engine="vllm", result="ok")  # the family, not a sample
    with pytest.raises(ValueError, match="engine"):
        metric(registry, "t_aborts_total", result="ok")


def test_metric_in_text_reads_prometheus_exposition() -> None:
    """The same reads on the text another process's /metrics answered."""
    registry = _registry()
    registry_text = generate_latest(registry).decode()
    assert metric_in_text(registry_text, "t_aborts_total", engine="vllm", result="ok") == 3
    text = '# TYPE t_aborts_total counter\nt_aborts_total{engine="vllm",result="ok"} 4.0\n'
    assert metric_in_text(text, "t_aborts_total", engine="vllm", result="ok") == 4
    with pytest.raises(KeyError):
        metric_in_text(text, "t_missing_total")


def test_a_scrape_sums_the_samples_whose_labels_include_the_ones_named() -> None:
    """What the real-engine suites read of another process's /metrics: an engine's extra
    labels need not be named, a sample nobody exposes reads as 0, buckets by bound."""
    text = (
        "# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\n'
        'vllm:num_requests_running{engine="1",model_name="tiny"} 3.0\n'
        "# TYPE t_latency_seconds histogram\n"
        't_latency_seconds_bucket{le="0.1"} 1.0\n'
        't_latency_seconds_bucket{le="+Inf"} 4.0\n'
        "t_latency_seconds_count 4.0\n"
        "t_latency_seconds_sum 2.0\n"
    )
    scraped = parse_metrics(text)
    assert scraped.value("vllm:num_requests_running") == 5
    assert scraped.value("vllm:num_requests_running", engine="1") == 3
    assert scraped.value("vllm:num_requests_waiting") == 0
    assert scraped.buckets("t_latency_seconds") == {0.1: 1.0, math.inf: 4.0}


def test_histogram_quantile_reads_what_happened_between_two_scrapes() -> None:
    """Linear interpolation inside the bucket the quantile falls in, as Prometheus does;
    beyond the last finite bucket its bound; NaN when nothing was observed."""

    def scrape(fast: int, slow: int, slower: int) -> str:
        return (
            "# TYPE t_seconds histogram\n"
            f't_seconds_bucket{{le="1.0"}} {fast}\n'
            f't_seconds_bucket{{le="2.0"}} {fast + slow}\n'
            f't_seconds_bucket{{le="+Inf"}} {fast + slow + slower}\n'
        )

    before, after = parse_metrics(scrape(5, 0, 0)), parse_metrics(scrape(7, 2, 1))
    assert histogram_quantile(0.4, before, after, "t_seconds") == 1.0  # rank 2 of 5: bound 1
    assert histogram_quantile(0.6, before, after, "t_seconds") == 1.5
    assert histogram_quantile(0.99, before, after, "t_seconds") == 2.0
    assert math.isnan(histogram_quantile(0.5, before, before, "t_seconds"))


def test_wait_until_returns_the_seconds_it_took_or_fails_with_a_message() -> None:
    """The blocking wait of the real-engine suites: seconds until the predicate held, or an
    AssertionError naming what was awaited."""
    calls: list[int] = []

    def third_time() -> bool:
        calls.append(1)
        return len(calls) == 3

    assert 0 <= wait_until(third_time, 5, "the third call", interval=0.001) < 1
    with pytest.raises(AssertionError, match="waiting for the engine to listen"):
        wait_until(lambda: False, 0.02, "the engine to listen", interval=0.005)


async def test_poll_until_returns_what_the_condition_found() -> None:
    """The first truthy result is returned; a coroutine function works as well."""
    calls: list[int] = []

    async def third_time() -> str | None:
        calls.append(1)
        return "found" if len(calls) == 3 else None

    assert await poll_until(third_time, 5, interval=0.001) == "found"


async def test_poll_until_fails_with_a_message_at_its_timeout() -> None:
    """A condition that never holds fails after the timeout, naming what was awaited and the
    last error it swallowed."""

    def refused() -> bool:
        raise ConnectionRefusedError("nobody listens")

    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(AssertionError, match=r"the engine to listen \(last error: Conn"):
        await poll_until(
            refused, 0.05, interval=0.01, what="the engine to listen", ignoring=(OSError,)
        )
    assert loop.time() - started < 1


async def test_within_bounds_a_wait_and_names_it() -> None:
    """An event that never comes fails as an AssertionError naming it."""
    with pytest.raises(AssertionError, match=r"the registry to empty: not done within 0\.05 s"):
        await within(asyncio.Event().wait(), 0.05, "the registry to empty")
    assert await within(asyncio.sleep(0, "done"), 1, "nothing") == "done"


def test_canaries_are_distinctive() -> None:
    """Each canary starts with its grep marker; filler bodies are made of the prompt."""
    assert CANARY_PROMPT.startswith(LEAK_MARKERS[0])
    assert CANARY_SECRET.startswith(LEAK_MARKERS[1])
    assert canary_bytes(1000).startswith(CANARY_PROMPT.encode()) and len(canary_bytes(1000)) == 1000


def test_leaks_are_found_in_tether_lines_only(tmp_path: Path) -> None:
    """A canary in any tether line (in-process or a process's) is found with its test; the
    test's own upstream and the test markers are not tether."""
    log = CollectedLog(tmp_path / "tests.log")
    log.mark_test("tests/test_a.py::test_one")
    log.add_lines(IN_PROCESS, f'{{"event": "request_finished", "body": "{CANARY_PROMPT}"}}')
    log.add_lines(UPSTREAM, f"ERROR engine body={CANARY_PROMPT}")
    log.mark_test("tests/test_b.py::test_two")
    log.add_lines(subprocess_source(42), f"Authorization: Bearer {CANARY_SECRET.upper()}")
    log.add_lines(IN_PROCESS, '{"event": "request_finished"}')
    log.close()

    leaks = find_leaks((tmp_path / "tests.log").read_text().splitlines())

    assert [(leak.test_id, leak.marker) for leak in leaks] == [
        ("tests/test_a.py::test_one", LEAK_MARKERS[0]),
        ("tests/test_b.py::test_two", LEAK_MARKERS[1]),
    ]
    assert main([str(tmp_path / "tests.log")]) == 1


def test_leak_check_refuses_a_log_that_proves_nothing(tmp_path: Path) -> None:
    """No log, or a log without lines from both kinds of tether, exits 2; a clean one 0."""
    path = tmp_path / "tests.log"
    assert main([str(path)]) == 2
    log = CollectedLog(path)
    log.add_lines(IN_PROCESS, '{"event": "request_finished"}')
    log.close()
    assert main([str(path)]) == 2  # nothing from a tether process
    log = CollectedLog(path)
    log.add_lines(IN_PROCESS, '{"event": "request_finished"}')
    log.add_lines(subprocess_source(7), '{"event": "request_finished"}')
    log.close()
    assert main([str(path)]) == 0


def test_leak_check_reads_the_logs_of_several_stages_as_one(tmp_path: Path) -> None:
    """Either log may hold the tether processes' lines; a canary in either one fails, and a
    missing one refuses to pass."""
    socket_free, sockets = tmp_path / "socket_free.log", tmp_path / "sockets.log"
    log = CollectedLog(socket_free)
    log.add_lines(IN_PROCESS, '{"event": "request_finished"}')
    log.close()
    log = CollectedLog(sockets)
    log.add_lines(subprocess_source(7), '{"event": "request_finished"}')
    log.close()
    assert main([str(socket_free), str(sockets)]) == 0
    assert main([str(socket_free), str(tmp_path / "missing.log")]) == 2
    log = CollectedLog(socket_free)
    log.mark_test("tests/test_a.py::test_one")
    log.add_lines(IN_PROCESS, f'{{"event": "x", "prompt": "{CANARY_PROMPT}"}}')
    log.close()
    assert main([str(socket_free), str(sockets)]) == 1


def test_log_stream_keeps_partial_lines_until_their_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a logger writes in pieces becomes whole prefixed lines, and still reaches stdout."""
    log = CollectedLog(tmp_path / "tests.log")
    stream = log.stream(IN_PROCESS)
    stream.write('{"event": ')
    stream.write('"one"}\n{"event": "two"}\n{"ev')
    log.close()
    assert (tmp_path / "tests.log").read_text() == (
        'in-process | {"event": "one"}\nin-process | {"event": "two"}\n'
    )
    assert capsys.readouterr().out == '{"event": "one"}\n{"event": "two"}\n{"ev'
