"""Every log line of a test run in one file, so that one grep can look for what must never be
logged (`tests.support.leak_check`).

What goes in, each line prefixed with where it came from:

- `in-process | ...`: tether run inside pytest (structlog and stdlib logging, configured as
  production configures them, at debug level), teed to the stdout pytest captures;
- `tether[<pid>] | ...`: the `tether` processes the tests start (stdout and stderr), and
  `tether-cli | ...` the output of the ones run to completion (`tether --help`, bad settings);
- `upstream | ...`: the tests' own upstreams (the fake engine served in-process), which are
  not tether: kept for reading, not searched for leaks;
- `=== <test id>`: a line before each test, so a finding names the test that caused it.

The file is `$TESTS_LOG_FILE`, or `.pytest-logs/tests.log` in the repository; each pytest
session starts it afresh.
"""

from __future__ import annotations

import io
import os
import sys
import threading
from pathlib import Path

LOG_FILE_VARIABLE = "TESTS_LOG_FILE"
DEFAULT_LOG_FILE = Path(__file__).resolve().parents[2] / ".pytest-logs" / "tests.log"
TEST_MARK = "=== "
IN_PROCESS = "in-process"
UPSTREAM = "upstream"
CLI = "tether-cli"


def is_tether_line(line: str) -> bool:
    """A line tether wrote (in-process, or one of its processes), not a marker or upstream."""
    return line.startswith((f"{IN_PROCESS} | ", "tether[", f"{CLI} | "))


def log_file() -> Path:
    """Where this run's log is collected."""
    configured = os.environ.get(LOG_FILE_VARIABLE)
    return Path(configured) if configured else DEFAULT_LOG_FILE


def subprocess_source(pid: int) -> str:
    return f"tether[{pid}]"


class CollectedLog:
    """The open log file of one pytest session; safe to write from any thread."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = path.open("w", encoding="utf-8", errors="backslashreplace")
        self._lock = threading.Lock()

    def mark_test(self, test_id: str) -> None:
        self._write(f"{TEST_MARK}{test_id}\n")

    def add_lines(self, source: str, text: str) -> None:
        """Lines one source produced (a trailing newline is optional)."""
        if text:
            lines = text.splitlines()
            self._write("".join(f"{source} | {line}\n" for line in lines))

    def stream(self, source: str) -> LineTee:
        """A text stream for a logger: what it writes goes to the current `sys.stdout` (so
        pytest's capture, capsys included, still sees it) and into this file."""
        return LineTee(self, source)

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def _write(self, text: str) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.write(text)
                self._file.flush()


class LineTee(io.TextIOBase):
    """See `CollectedLog.stream`. Partial lines are held until their newline."""

    def __init__(self, log: CollectedLog, source: str) -> None:
        super().__init__()
        self._log = log
        self._source = source
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        sys.stdout.write(text)
        with self._lock:
            complete, newline, partial = (self._partial + text).rpartition("\n")
            self._partial = partial
        if newline:
            self._log.add_lines(self._source, complete)
        return len(text)

    def flush(self) -> None:
        sys.stdout.flush()

    def writable(self) -> bool:
        return True
