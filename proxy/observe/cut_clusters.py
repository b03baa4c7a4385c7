"""Cuts of one route that keep happening at the same age: the mark of an idle timeout in
front of tether (AWS ALB 60 s, Envoy 15 s, Higress 10 s), which no single cut can show.

Pure: the caller says when each cut happened. Memory is a small ring of recent cuts per
route (routes are bounded metric labels), and the clusters already reported.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Cluster:
    """Cuts of one route at the same age, seen for the first time in the window."""

    route: str
    age: float  # seconds: the mean age of its cuts, to a tenth
    cuts: int  # how many of the recent cuts fall at that age
    causes: tuple[str, ...]  # the causes among them, sorted


@dataclass(frozen=True, slots=True)
class _Cut:
    at: float
    age: float
    cause: str


class CutClusters:
    """Finds `least` or more cuts of one route within `window` seconds whose ages lie within
    `tolerance` of each new one's; reports each cluster once per route, age and window."""

    __slots__ = ("_cuts", "_least", "_min_age", "_reported", "_ring", "_tolerance", "_window")

    def __init__(
        self,
        *,
        window: float = 600.0,
        tolerance: float = 0.5,
        least: int = 3,
        min_age: float = 1.0,
        ring: int = 32,
    ) -> None:
        self._window = window
        self._tolerance = tolerance
        self._least = least
        # Younger cuts are clients that changed their minds, not timeouts anyone configures.
        self._min_age = min_age
        self._ring = ring
        self._cuts: dict[str, deque[_Cut]] = {}
        self._reported: dict[str, deque[_Cut]] = {}

    def add(self, route: str, age: float, cause: str, now: float) -> Cluster | None:
        """One more cut of `route`, `age` seconds into its request, noticed at `now` (the
        monotonic clock); the cluster it completes, if it is one not reported yet."""
        if age < self._min_age:
            return None
        cuts = self._cuts.get(route)
        if cuts is None:
            cuts = self._cuts[route] = deque(maxlen=self._ring)
        cuts.append(_Cut(now, age, cause))
        since = now - self._window
        tolerance = self._tolerance
        near = [cut for cut in cuts if cut.at >= since and abs(cut.age - age) <= tolerance]
        if len(near) < self._least:
            return None
        center = round(sum(cut.age for cut in near) / len(near), 1)
        reported = self._reported.get(route)
        if reported is None:
            reported = self._reported[route] = deque(maxlen=self._ring)
        # The same cluster seen again, its centre moved by the cuts since (each of its cuts
        # lies within the tolerance of the one that completed it: twice that of each other).
        if any(old.at >= since and abs(old.age - center) <= 2 * tolerance for old in reported):
            return None
        reported.append(_Cut(now, center, cause))
        return Cluster(route, center, len(near), tuple(sorted({cut.cause for cut in near})))
