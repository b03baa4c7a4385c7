"""Distinctive values the tests send where a client would put private data.

Request bodies carry `CANARY_PROMPT` instead of a generic "hi"; tokens and keys are
`CANARY_SECRET`. Neither may ever appear in a log line: `tests.support.leak_check` greps the
collected log of a whole test run for their `LEAK_MARKERS` (see `tests.support.collected_log`).
"""

from __future__ import annotations

# What the grep looks for (case-insensitively): each canary starts with its marker, so a log
# that prints a body or a token cut short after a few dozen characters is still caught.
PROMPT_MARKER = "canary-prompt-qzjx"
SECRET_MARKER = "canary-secret-qzjx"
LEAK_MARKERS: tuple[str, ...] = (PROMPT_MARKER, SECRET_MARKER)

# Prompt text: what a user asks the model.
CANARY_PROMPT = f"{PROMPT_MARKER}: tell me what tether does with my words"
# A credential: admin tokens, engine admin keys, Authorization headers.
CANARY_SECRET = f"{SECRET_MARKER}-51d4e0"


def canary_bytes(size: int) -> bytes:
    """`size` bytes of prompt text (the canary repeated), for bodies whose content is not the
    point of the test (uploads, streamed bodies)."""
    text = (CANARY_PROMPT + " ").encode()
    return (text * (size // len(text) + 1))[:size]
