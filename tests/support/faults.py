"""Faults a test injects into tether at its named points (`proxy.faults`): a bug raised there,
holding a secret in a local variable as real code might."""

from __future__ import annotations

from .canaries import CANARY_SECRET


class TetherBug(RuntimeError):
    """Stands for any bug: raised from inside tether's request path."""


class BugAt:
    """Raises a `TetherBug` at one named point, every time it is reached."""

    def __init__(self, point: str) -> None:
        self.point = point

    def at(self, point: str) -> None:
        if point == self.point:
            secret_in_a_local = CANARY_SECRET
            raise TetherBug(f"a bug at {point} ({len(secret_in_a_local)})")
