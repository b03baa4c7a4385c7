"""What tether learns of the engine's front end while it stops requests: how long an engine
step takes, and whether the front end misses aborts.

An engine front end with several processes (vLLM with `--api-server-count` above 1, its
default for a data-parallel pod) answers 200 to an abort that reached a process not holding
the request, which then runs on, while the process that does hold it notices its own
connection close within milliseconds. Once it has missed aborts of requests it certainly held
(two of the last eight), later stops drop the connection as the call goes out, as a plain
close would, for a minute after the last miss; one stop in sixteen still waits for its
confirmation, to notice when misses stop.
"""

from __future__ import annotations

from collections import deque

from ..engines import ConfirmRule

# What a confirm window adds to the engine's steps: the call's way back, timer resolution.
_WINDOW_MARGIN = 0.01
# Until a stream's steps were measured: a step this long.
_DEFAULT_STEP = 0.02
# The front end misses aborts when this many of the last _OUTCOMES stops that waited to
# confirm (of requests it certainly held) missed: one slow confirmation is not a pattern.
_MISSES = 2
_OUTCOMES = 8
_DROP_MODE_SECONDS = 60.0
_SAMPLE_EVERY = 16


class FrontEnd:
    """What tether has learnt of the engine's front end: how long a step takes (from the
    streams it relayed), and whether it misses aborts (several processes behind one port)."""

    __slots__ = ("_cap", "_drop_until", "_outcomes", "_rule", "_stops", "step")

    def __init__(self, rule: ConfirmRule, cap: float) -> None:
        self._rule = rule
        self._cap = cap
        self.step = _DEFAULT_STEP
        self._outcomes: deque[bool] = deque(maxlen=_OUTCOMES)
        self._drop_until = 0.0
        self._stops = 0

    def note_step(self, seconds: float) -> None:
        """A stream's step, measured when its client left (a moving average)."""
        self.step += 0.25 * (seconds - self.step)

    def window(self, step: float | None) -> float:
        """The confirm window for a request whose own step is `step` (None: not measured)."""
        steps = self._rule.steps * (step if step is not None else self.step) + _WINDOW_MARGIN
        return min(max(steps, self._rule.floor), self._cap)

    def confirm_outcome(self, missed: bool, now: float) -> bool:
        """A stop that waited to confirm an abort of a request the engine held ended (its first
        call `missed` or not). True when that starts the drop mode."""
        self._outcomes.append(missed)
        if not missed or sum(self._outcomes) < _MISSES:
            return False
        starts = now >= self._drop_until
        self._drop_until = now + _DROP_MODE_SECONDS
        return starts

    def drops_at_once(self, now: float) -> bool:
        """Whether this stop drops the connection when its call goes out (every sixteenth
        waits to confirm, so a front end that stopped missing is noticed)."""
        if now >= self._drop_until:
            return False
        self._stops += 1
        return self._stops % _SAMPLE_EVERY != 0
