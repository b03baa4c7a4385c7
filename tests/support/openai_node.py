"""The openai Node SDK as a client of tether: the official `openai` npm package, run by `node`
on `openai_node_chat.mjs` beside this file, streams one chat completion.

CI installs node and the pinned package (`.ci/run`) and names the package's node_modules
directory in `TESTS_NODE_MODULES`. Elsewhere the tests use the directory CI installs into,
`~/.cache/tether/node`, and skip where node or the package is missing there. Where the
variable is set nothing skips: a node or a package CI failed to install fails the tests."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The newest 4.x: 5 and later support Node 20 and later only, and Debian 12's nodejs is 18.
OPENAI_NODE_VERSION = "4.104.0"
NODE_MODULES_VARIABLE = "TESTS_NODE_MODULES"
DEFAULT_NODE_MODULES = Path.home() / ".cache" / "tether" / "node" / "node_modules"
_SCRIPT = Path(__file__).with_name("openai_node_chat.mjs")
# The script's own client gives up after 20 s; node starts in well under a second.
_BOUND = 30.0


@dataclass(frozen=True)
class NodeChat:
    """What the Node SDK read: the text of its chunks, or the error it raised."""

    text: str | None = None
    chunks: int = 0
    error_class: str | None = None
    error_message: str | None = None
    error_status: int | None = None


def node_sdk_missing() -> str | None:
    """Why the Node SDK cannot run here (a skip's reason), or None."""
    if os.environ.get(NODE_MODULES_VARIABLE):
        return None
    if shutil.which("node") is None:
        return "node is not installed (.ci/run installs it)"
    if not (DEFAULT_NODE_MODULES / "openai" / "package.json").is_file():
        return (
            f"the openai npm package is not in {DEFAULT_NODE_MODULES} (.ci/run installs it "
            f"there; {NODE_MODULES_VARIABLE} names another node_modules directory)"
        )
    return None


async def openai_node_chat(port: int, body: dict[str, Any]) -> NodeChat:
    """A streamed chat completion `body` through the Node SDK against the server on `port`."""
    modules = os.environ.get(NODE_MODULES_VARIABLE) or str(DEFAULT_NODE_MODULES)
    node = await asyncio.create_subprocess_exec(
        "node",
        str(_SCRIPT),
        str(port),
        json.dumps(body),
        env={**os.environ, NODE_MODULES_VARIABLE: modules},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        output, errors = await asyncio.wait_for(node.communicate(), _BOUND)
    finally:
        if node.returncode is None:
            node.kill()
            await node.wait()
    assert node.returncode == 0, f"the Node SDK's script failed: {errors.decode()}"
    read = json.loads(output)
    if "error" not in read:
        return NodeChat(text=read["text"], chunks=read["chunks"])
    error = read["error"]
    return NodeChat(
        error_class=error["class"], error_message=error["message"], error_status=error["status"]
    )
