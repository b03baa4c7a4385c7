"""The stages CI runs the tests in: every test in exactly one, every stage run by CI (the soak
by hand), and a `socket_free` test kept from the machine."""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
from pathlib import Path

import pytest

from .support.stages import (
    REAL_ENGINES,
    SOAK,
    SOCKET_FREE,
    SOCKETS,
    STAGES,
    NotSocketFreeError,
    misplaced,
    no_sockets_or_processes,
    stages_of,
)

pytestmark = pytest.mark.socket_free

CI = Path(__file__).resolve().parents[1] / ".ci"


def test_a_test_is_in_the_stage_its_marker_names_and_else_in_sockets() -> None:
    """Unmarked tests need no marker to run: they are in the sockets stage."""
    assert stages_of(["parametrize", "timeout"]) == [SOCKETS]
    assert stages_of([SOCKET_FREE, "parametrize"]) == [SOCKET_FREE]
    assert stages_of(["vllm", "skip"]) == ["vllm"]
    assert stages_of([SOAK]) == [SOAK]


def test_a_test_whose_markers_name_two_stages_is_reported() -> None:
    """A test in two stages would run twice or, deselected by one, be thought run by the other."""
    assert (
        misplaced([("tests/test_a.py::test_one", [SOCKET_FREE]), ("tests/test_b.py::test_two", [])])
        == []
    )
    assert misplaced([("tests/real_vllm/test_c.py::test_three", ["vllm", SOCKET_FREE])]) == [
        "tests/real_vllm/test_c.py::test_three: socket_free, vllm"
    ]


def test_ci_runs_every_stage_but_the_soak() -> None:
    """.ci/run runs the socket-free and socket stages on both data planes, and each real
    engine's suite, which selects its stage: no test is left to a stage nobody runs."""
    run = (CI / "run").read_text()
    assert set(STAGES) == {SOCKET_FREE, SOCKETS, *REAL_ENGINES, SOAK}
    for stage in (SOCKET_FREE, SOCKETS):
        runs = re.findall(rf"^(.*)python -m pytest --stage {stage}\b", run, re.MULTILINE)
        assert any("TETHER_NO_EXTENSIONS=1" in line for line in runs), stage
        assert any("TETHER_NO_EXTENSIONS=1" not in line for line in runs), stage
    for engine in REAL_ENGINES:
        assert re.search(rf"^bash \.ci/{engine}-suite\.sh$", run, re.MULTILINE), engine
    assert '--stage "$engine"' in (CI / "real-engine-suite.sh").read_text()


def test_a_socket_free_test_can_bind_connect_or_start_nothing() -> None:
    """Each attempt raises, and is recorded so that one the code under test swallows still
    fails the test."""
    used: list[str] = []
    with no_sockets_or_processes(used), socket.socket() as sock:
        with pytest.raises(NotSocketFreeError):
            sock.bind(("127.0.0.1", 0))
        with pytest.raises(NotSocketFreeError):
            sock.connect(("127.0.0.1", 9))
        with pytest.raises(NotSocketFreeError):
            subprocess.run(["true"], check=False)
    assert used == ["socket.bind", "socket.connect", "a subprocess"]


def test_a_socket_free_test_can_still_make_an_event_loop() -> None:
    """asyncio's loop makes its wake-up socket pair without binding or connecting anything."""

    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    with no_sockets_or_processes([]):
        assert asyncio.run(answer()) == 42
