"""`python -m tests.support.leak_check [LOG ...]`: fail if a test run's collected log holds a
canary.

Run after the suite (`.ci/run` does, over the logs of its stages together). Exit codes: 0
clean; 1 a canary was logged (the lines are printed with the test that produced them); 2 the
check would prove nothing (a log missing, or logs without tether output from both in-process
and subprocess tethers: collection is broken).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .canaries import LEAK_MARKERS
from .collected_log import IN_PROCESS, TEST_MARK, is_tether_line, log_file

SHOWN = 40  # leaked lines printed in full (each cut to SHOWN_WIDTH characters)
SHOWN_WIDTH = 400


@dataclass(frozen=True)
class Leak:
    test_id: str
    line_number: int
    marker: str
    line: str


def find_leaks(lines: Iterable[str], markers: tuple[str, ...] = LEAK_MARKERS) -> list[Leak]:
    """Every line tether wrote that holds a marker (case-insensitively), with the test it was
    logged under."""
    lowered = [marker.lower() for marker in markers]
    test_id = "(before the first test)"
    leaks = []
    for number, line in enumerate(lines, start=1):
        if line.startswith(TEST_MARK):
            test_id = line[len(TEST_MARK) :].rstrip("\n")
            continue
        if not is_tether_line(line):
            continue
        text = line.lower()
        for marker, low in zip(markers, lowered, strict=True):
            if low in text:
                leaks.append(Leak(test_id, number, marker, line.rstrip("\n")))
                break
    return leaks


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    paths = [Path(arg) for arg in args] or [log_file()]
    missing = [str(path) for path in paths if not path.is_file()]
    if missing:
        print(f"leak check: no collected log at {', '.join(missing)} (run the test suite first)")
        return 2
    logs = {
        path: path.read_text(encoding="utf-8", errors="backslashreplace").splitlines()
        for path in paths
    }
    lines = [line for log in logs.values() for line in log]
    named = ", ".join(str(path) for path in paths)
    in_process = sum(1 for line in lines if line.startswith(f"{IN_PROCESS} | "))
    subprocess = sum(1 for line in lines if line.startswith("tether["))
    if not in_process or not subprocess:
        print(
            f"leak check: {named} {'has' if len(paths) == 1 else 'have'} {in_process} "
            f"in-process and {subprocess} subprocess tether lines; both must be there for the "
            "check to mean anything (log collection broken, or only part of the suite ran)"
        )
        return 2
    leaks = [(path, leak) for path, log in logs.items() for leak in find_leaks(log)]
    if not leaks:
        print(
            f"leak check: no canary ({', '.join(LEAK_MARKERS)}) in {len(lines)} lines of {named} "
            f"({in_process} in-process, {subprocess} from tether processes)"
        )
        return 0
    by_test: dict[str, int] = {}
    for _, leak in leaks:
        by_test[leak.test_id] = by_test.get(leak.test_id, 0) + 1
    print(f"leak check: {len(leaks)} log lines of {named} hold a canary, in {len(by_test)} tests:")
    for test_id, count in sorted(by_test.items()):
        print(f"  {count:4d}  {test_id}")
    print(f"first {min(SHOWN, len(leaks))} lines:")
    for path, leak in leaks[:SHOWN]:
        shown = leak.line if len(leak.line) <= SHOWN_WIDTH else leak.line[:SHOWN_WIDTH] + " ..."
        print(f"  {path.name}:{leak.line_number} [{leak.marker}] {shown}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
