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

from ..processes import on_core
from .stacks import MODEL_NAME, run_setup_script
from .tether import Tether


def openai_client(tether: Tether) -> Any:
    """The openai SDK (installed by .ci/real-engine-suite.sh) talking to `tether`."""
    import openai  # only needed when a real-engine suite runs

    return openai.OpenAI(base_url=tether.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def openai_stream(
    tether: Tether, client_request_id: str, max_tokens: int, chunks: int
) -> tuple[Any, list[str]]:
    """A streaming chat through the openai SDK as `client_request_id`, its first `chunks`
    chunks read: (the stream, still open, the `id` of each chunk read)."""
    stream = openai_client(tether).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=max_tokens,
        stream=True,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": client_request_id},
    )
    ids = []
    for chunk in stream:
        ids.append(chunk.id)
        if len(ids) == chunks:
            break
    return stream, ids


def openai_completion(tether: Tether, client_request_id: str, max_tokens: int) -> Any:
    """A non-streaming chat through the openai SDK as `client_request_id`; its raw response
    (`.headers`, `.parse()`)."""
    return openai_client(tether).chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=max_tokens,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": client_request_id},
    )


def install_aiperf() -> pathlib.Path:
    """The aiperf executable from its cached venv (built by tests/engines/aiperf.sh if
    missing)."""
    return pathlib.Path(run_setup_script("aiperf.sh")["AIPERF"])


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
