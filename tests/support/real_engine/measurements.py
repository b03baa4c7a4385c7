"""Numbers a real-engine suite measures on its engine, printed at the end of the run."""

from __future__ import annotations

import json
import os
import pathlib
import statistics


class Measurements:
    """Named measurements grouped by topic; printed in pytest's terminal summary."""

    def __init__(self, env_var: str) -> None:
        """`env_var` names a file every measurement is appended to as a JSON line, if set."""
        self.rows: list[tuple[str, str, float]] = []
        self._env_var = env_var

    def add(self, topic: str, name: str, value: float) -> None:
        self.rows.append((topic, name, value))
        out = os.environ.get(self._env_var)
        if out:
            with pathlib.Path(out).open("a") as handle:
                handle.write(json.dumps({"topic": topic, "name": name, "value": value}) + "\n")

    def lines(self) -> list[str]:
        grouped: dict[tuple[str, str], list[float]] = {}
        for topic, name, value in self.rows:
            grouped.setdefault((topic, name), []).append(value)
        lines = []
        for (topic, name), values in grouped.items():
            if len(values) == 1:
                lines.append(f"{topic:<22} {name:<60} {values[0]:.3f}")
            else:
                lines.append(
                    f"{topic:<22} {name:<60} median {statistics.median(values):.3f} "
                    f"max {max(values):.3f} (n={len(values)})"
                )
        return lines
