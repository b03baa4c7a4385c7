"""llama-server's own evidence of when it let a request go: its log (`--log-timestamps
--log-prefix`), read as task events at llama-server's own times.

Never its HTTP API while a measurement runs: the HTTP thread of a request whose client left
checks the socket only when its one-second wait for results times out, and every result of
any request (a `/metrics` or `/slots` answer included) restarts that second, so polling would
hide the very behaviour measured. The events:

- `launched`: a slot took the task (`slot launch_slot_: id S | task T | processing task`);
- `cancelled`: the HTTP thread noticed its client had left (`srv stop: cancel task, id_task
  = T`), which also drops the task from the queue if it had not started;
- `released`: the slot let the task go (`slot release: id S | task T | stop processing:
  n_tokens = N`), after a cancel or at the end of the answer.

A line's time is minutes.seconds.milliseconds.microseconds since llama-server's log started,
on the system clock; `ServerLog.wall` turns it into `time.time()` seconds, from one
calibration: `DELETE /v1/stream?conv_id=<unknown id>` logs a warning from the HTTP thread
while the call is in flight, and touches neither the task queue nor any result.
"""

from __future__ import annotations

import re
import time
import urllib.request
import uuid
from dataclasses import dataclass

from ..support.processes import LogFile
from ..support.waiting import wait_until

# The timestamp and level `--log-timestamps --log-prefix` put before every line.
_STAMP = r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) [IWED] "
LAUNCHED = _STAMP + r"slot +launch_slot_: id +(\d+) \| task (\d+) \| processing task"
CANCELLED = _STAMP + r"srv +stop: cancel task, id_task = (\d+)"
RELEASED = _STAMP + r"slot +release: id +(\d+) \| task (\d+) \| stop processing: n_tokens = (\d+)"
UNKNOWN_STREAM = _STAMP + r"srv +evict_and_ca.*: stop on unknown stream session, conv_id="
# The calibration's round trip must be this short for the offset to be trusted (seconds).
CALIBRATION_BOUND = 0.005


def _seconds(match: re.Match[str]) -> float:
    minutes, seconds, millis, micros = (int(match.group(i)) for i in range(1, 5))
    return minutes * 60 + seconds + millis / 1e3 + micros / 1e6


@dataclass(frozen=True)
class TaskEvent:
    """One event of a task, at llama-server's time (seconds since its log started)."""

    at: float
    task: int
    slot: int | None = None
    # At release: the tokens in the slot (prompt and answer).
    tokens: int | None = None


class ServerLog:
    """llama-server's log file, read from marks, and the offset from its clock to ours."""

    def __init__(self, log: LogFile, url: str) -> None:
        self.log = log
        self._url = url
        self._offset: float | None = None

    def mark(self) -> int:
        return self.log.mark()

    def launched(self, mark: int) -> list[TaskEvent]:
        return [
            TaskEvent(_seconds(m), int(m.group(6)), int(m.group(5)))
            for m in self.log.find_since(mark, LAUNCHED)
        ]

    def cancelled(self, mark: int) -> list[TaskEvent]:
        return [
            TaskEvent(_seconds(m), int(m.group(5))) for m in self.log.find_since(mark, CANCELLED)
        ]

    def released(self, mark: int) -> list[TaskEvent]:
        return [
            TaskEvent(_seconds(m), int(m.group(6)), int(m.group(5)), int(m.group(7)))
            for m in self.log.find_since(mark, RELEASED)
        ]

    def wait_released(self, mark: int, task: int, timeout: float) -> TaskEvent:
        """The release of `task`, once logged after `mark`."""
        pattern = _STAMP + rf"slot +release: id +\d+ \| task {task} \|"
        self.log.wait_for(mark, pattern, timeout)
        return next(event for event in self.released(mark) if event.task == task)

    def wait_all_released(self, mark: int, timeout: float) -> None:
        """Every task launched after `mark` released, waiting up to `timeout`."""

        def idle() -> bool:
            released = {event.task for event in self.released(mark)}
            return all(event.task in released for event in self.launched(mark))

        wait_until(idle, timeout, "llama-server to release every task", interval=0.05)

    def wall(self, event: TaskEvent) -> float:
        """The `time.time()` at which llama-server logged `event`."""
        return event.at + self.offset()

    def offset(self) -> float:
        """Our wall clock minus llama-server's log clock (both the system clock: constant for
        the server's life), measured once."""
        if self._offset is None:
            self._offset = self._calibrate()
        return self._offset

    def _calibrate(self) -> float:
        best: tuple[float, float] | None = None  # (round trip, offset)
        for _ in range(5):
            conv_id = f"tether-clock-{uuid.uuid4().hex}"
            mark = self.mark()
            request = urllib.request.Request(
                f"{self._url}/v1/stream?conv_id={conv_id}", method="DELETE"
            )
            sent = time.time()
            with urllib.request.urlopen(request, timeout=5) as response:
                assert response.status == 204, response.status
            answered = time.time()
            logged = self.log.wait_for(mark, UNKNOWN_STREAM + re.escape(conv_id), 5.0)
            candidate = (answered - sent, (sent + answered) / 2 - _seconds(logged))
            if best is None or candidate < best:
                best = candidate
            if best[0] < CALIBRATION_BOUND:
                break
        assert best is not None and best[0] < 10 * CALIBRATION_BOUND, best
        return best[1]
