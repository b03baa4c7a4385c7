"""The real clients both real-engine suites drive tether with: the openai SDK, and aiperf
(NVIDIA's benchmark client), which cancels a share of its streaming requests on its own
schedule; each suite then checks from its engine's evidence that exactly those stopped.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
from dataclasses import dataclass
from typing import Any

from .processes import MODEL_NAME, REPO, Tether, on_core

AIPERF_SETUP = REPO / "tests" / "engines" / "aiperf.sh"


def openai_client(tether: Tether) -> Any:
    """The openai SDK (installed by .ci/real-engine-suite.sh) talking to `tether`."""
    import openai  # only needed when a real-engine suite runs

    return openai.OpenAI(base_url=tether.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def install_aiperf() -> pathlib.Path:
    """The aiperf executable from its cached venv (built by the setup script if missing)."""
    result = subprocess.run(
        ["bash", str(AIPERF_SETUP)], check=True, capture_output=True, text=True, timeout=1200
    )
    return pathlib.Path(result.stdout.strip().splitlines()[-1].split("=", 1)[1])


@dataclass(frozen=True)
class CancellingRun:
    """What aiperf recorded: one record per request it sent."""

    records: list[dict[str, Any]]

    @property
    def cancelled(self) -> int:
        return sum(1 for r in self.records if r["metadata"].get("was_cancelled"))

    @property
    def other_errors(self) -> list[Any]:
        return [
            r["error"]
            for r in self.records
            if r.get("error") and not r["metadata"].get("was_cancelled")
        ]


def run_with_cancellations(
    aiperf: pathlib.Path,
    url: str,
    tokenizer: pathlib.Path,
    requests: int,
    delay: float,
    artifact_dir: pathlib.Path,
) -> CancellingRun:
    """`requests` streaming chat requests, 4 at a time, half of them cancelled `delay` s
    after sending; aiperf runs on core 0 beside tether, the engine has core 1."""
    # aiperf refuses a local tokenizer directory when HF offline mode is set at all (it then
    # only looks in the hub cache); the directory is local, so nothing is downloaded.
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    argv = [
        *on_core(0),
        str(aiperf),
        "profile",
        "--model",
        MODEL_NAME,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--request-count",
        str(requests),
        "--concurrency",
        "4",
        "--request-cancellation-rate",
        "50",
        "--request-cancellation-delay",
        str(delay),
        "--isl",
        "32",
        "--osl",
        "600",
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",
        "--random-seed",
        "7",
        "--no-server-metrics",
        "--no-gpu-telemetry",
        "--ui",
        "none",
        "--artifact-dir",
        str(artifact_dir),
    ]
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = (artifact_dir / "profile_export.jsonl").read_text().splitlines()
    return CancellingRun([json.loads(line) for line in lines])
