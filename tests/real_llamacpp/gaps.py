"""Known gaps: behaviour tether promises against llama-server but does not keep yet (issue
30). A test of one is a strict xfail that only a `KnownGap` satisfies: any other failure (a
scenario that did not run as designed) fails the test instead of passing as the expected
failure, and once tether keeps the promise the test passes, fails as XPASS, and its mark
must go."""

from __future__ import annotations

import pytest

ISSUE = "issue 30 (llama.cpp server as a first-class engine)"


class KnownGap(AssertionError):
    """tether does not keep this promise yet."""


def gap(holds: bool, message: str) -> None:
    """Assert a promise of a known gap."""
    if not holds:
        raise KnownGap(message)


def known_gap(reason: str) -> pytest.MarkDecorator:
    """The mark of a test of a known gap."""
    return pytest.mark.xfail(strict=True, raises=KnownGap, reason=f"{ISSUE}: {reason}")
