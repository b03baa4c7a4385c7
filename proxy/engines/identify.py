"""Which engine answers, from what it says about itself on routes that leak nothing.

Pure: the probes are plain GETs tether's upstream client sends (`PROBE_PATHS`); `identify`
reads their answers. Each rule asks for a shape only that engine's own route gives, read in
its installed source or from the running engine (vLLM 0.32, SGLang 0.5.23, llama.cpp b11434);
no probe asks for anything secret (never SGLang's `/get_server_info`, which answers with its
API keys), and no answer is kept beyond the engine's name, its version and the route that
named it.

| engine | its answer | profile |
|---|---|---|
| vLLM | `GET /version` `{"version": ...}` and `GET /v1/models` cards `"owned_by": "vllm"` | vllm |
| SGLang | `GET /model_info` (older: `/get_model_info`): `model_path`, `is_generation` | sglang |
| llama.cpp server | `GET /props` with `default_generation_settings` and `total_slots` | llamacpp |
| TGI | `GET /info` with `"router": "text-generation-router"` | none |
| Ollama | `GET /api/version` `{"version": ...}` (and no `/version`) | none |
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# What tether asks, in order, until the answers name an engine (most specific first; SGLang
# 0.5.23 logs a deprecation warning for each `/get_model_info`, asked only where `/model_info`
# is not served).
PROBE_PATHS = (
    "/model_info",
    "/get_model_info",
    "/props",
    "/info",
    "/version",
    "/v1/models",
    "/api/version",
)
# An answer larger than this is no identity document (a model list may be long; the rest is
# not read).
MAX_PROBE_ANSWER = 256 * 1024


@dataclass(frozen=True, slots=True)
class Identity:
    """What an engine said it is: its product (`vllm`, `sglang`, `llamacpp`, `tgi`,
    `ollama`), the name of the engine profile tether serves it with (`proxy.engines.Engine`
    values), its version where it gave one, and the answer that named it."""

    product: str
    profile: str
    version: str | None
    evidence: str
    # Requests the engine generates at once, where it says (llama-server's `total_slots`, its
    # `-np`); the rest wait in its queue.
    slots: int | None = None


def identify(answers: Mapping[str, Any]) -> Identity | None:
    """The engine the probes' answers name, or None. `answers` maps each probe path that was
    answered 200 with a JSON document to that document."""
    for path in ("/model_info", "/get_model_info"):
        model_info = _object(answers.get(path))
        if "model_path" in model_info and "is_generation" in model_info:
            return Identity("sglang", "sglang", None, f"GET {path}")
    props = _object(answers.get("/props"))
    if "default_generation_settings" in props and "total_slots" in props:
        return Identity(
            "llamacpp",
            "llamacpp",
            _text(props.get("build_info")),
            "GET /props",
            _count(props.get("total_slots")),
        )
    info = _object(answers.get("/info"))
    if info.get("router") == "text-generation-router":
        return Identity("tgi", "none", _text(info.get("version")), "GET /info")
    version = _text(_object(answers.get("/version")).get("version"))
    if version is not None and "vllm" in _model_owners(answers.get("/v1/models")):
        return Identity("vllm", "vllm", version, "GET /version, GET /v1/models")
    ollama = _text(_object(answers.get("/api/version")).get("version"))
    if ollama is not None and version is None:
        return Identity("ollama", "none", ollama, "GET /api/version")
    return None


def _object(document: Any) -> dict[str, Any]:
    return document if isinstance(document, dict) else {}


def _text(value: Any) -> str | None:
    """A short string from an answer (a version), never a long one."""
    return value[:64] if isinstance(value, str) and value else None


def _count(value: Any) -> int | None:
    """A positive whole number from an answer, never anything else (a bool is no count)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _model_owners(document: Any) -> set[str]:
    cards = _object(document).get("data")
    if not isinstance(cards, list):
        return set()
    return {
        card["owned_by"]
        for card in cards
        if isinstance(card, dict) and isinstance(card.get("owned_by"), str)
    }
