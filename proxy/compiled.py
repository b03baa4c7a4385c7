"""The compiled data plane: which modules mypyc compiles, and the switch back to pure Python.

A regular install (`pip install .`, the Docker image) compiles the modules below to C with
mypyc where a C compiler and Python's headers are present (`setup.py`), and keeps their `.py`
source beside each extension module. Python's import system prefers the extension module;
`TETHER_NO_EXTENSIONS=1` in the environment puts a finder in front of it (at `import proxy`,
before any of them is imported) that loads the `.py` source instead, so one install runs
either way. The same code runs on both paths: mypyc compiles what `mypy --strict` checks.

This module is stdlib only: `setup.py` reads the list from it before anything is installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from types import ModuleType

# The data plane, every one of them on the path of each chunk or each request: a request's
# life and the stops of the engine's work included (tests reach them through `proxy.faults`,
# never by patching, so they compile). Not compiled: `engines/token_shapes.py`, the data the
# token counter reads (mypyc's dataclasses take ClassVar declarations for fields,
# mypyc/mypyc#1122), and `request/body_stream.py` (the streamed body is an async generator,
# which mypyc does not compile). (`request/state.py`'s dataclass once failed at import
# compiled, on a field annotated `object`: `KeyError: 'object'` from mypyc 1.x; its classes
# are plain ones now.)
COMPILED_MODULES = (
    "proxy.upstream.connection",
    "proxy.upstream.exchange",
    "proxy.upstream.relay",
    "proxy.upstream.backpressure",
    "proxy.upstream.pool",
    "proxy.wire.ids",
    "proxy.wire.json_members",
    "proxy.wire.tokens",
    "proxy.wire.usage_events",
    "proxy.wire.event_log",
    "proxy.wire.headers",
    "proxy.wire.callers",
    "proxy.outcomes",
    "proxy.request.accounting",
    "proxy.request.registry",
    "proxy.observe.metrics",
    "proxy.server.handler",
    "proxy.server.respond",
    "proxy.server.whole_answer",
    "proxy.server.early_commit",
    "proxy.request.naming",
    "proxy.request.body",
    "proxy.request.state",
    "proxy.server.context",
    "proxy.request.abort_report",
    "proxy.request.websocket",
    "proxy.aborts.tracker",
    "proxy.aborts.calls",
    "proxy.aborts.queue",
    "proxy.aborts.front_end",
    "proxy.aborts.stop",
)

# "1" at run time: the pure-Python modules even where compiled ones are installed. (At build
# time: "1" compiles nothing, "0" compiles even in an editable install; see setup.py.)
NO_EXTENSIONS_VARIABLE = "TETHER_NO_EXTENSIONS"


def pure_forced() -> bool:
    """Whether the environment asks for the pure-Python modules."""
    return os.environ.get(NO_EXTENSIONS_VARIABLE, "") == "1"


class PureSourceFinder:
    """Finds a compiled module's `.py` source before the path finder finds its extension
    module: first on `sys.meta_path`, it makes `import proxy.upstream.relay` run `relay.py`. (A
    meta path finder by its `find_spec`; `importlib.abc` would add milliseconds to every
    `tether` start, `tether abort` included.)"""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES or path is None:
            return None
        filename = fullname.rpartition(".")[2] + ".py"
        for directory in path:
            source = os.path.join(directory, filename)
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(fullname, source)
        return None  # no source beside it: the regular finders decide


def use_pure_modules() -> None:
    """From now on the compiled modules load from their `.py` source. Must run before any
    of them is imported (`proxy/__init__.py` calls it)."""
    if not any(isinstance(finder, PureSourceFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, PureSourceFinder())


def _built() -> tuple[str, ...]:
    """The modules of `COMPILED_MODULES` with an extension module beside their source."""
    # The directory holding the `proxy` package: each module's path is its dotted name.
    top = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    suffixes = importlib.machinery.EXTENSION_SUFFIXES
    return tuple(
        name
        for name in COMPILED_MODULES
        if any(os.path.isfile(os.path.join(top, *name.split(".")) + suffix) for suffix in suffixes)
    )


def build_complete() -> bool:
    """Whether every compiled module is there. All or none run compiled: a compiled module
    calls the others' C directly, and one imported from its source would leave that C
    uninitialised."""
    return len(_built()) == len(COMPILED_MODULES)


def compiled_modules() -> tuple[str, ...]:
    """The modules of `COMPILED_MODULES` that run (or, not imported yet, will run) from an
    extension module."""
    compiled = []
    for name in COMPILED_MODULES:
        module = sys.modules.get(name)
        spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
        if spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader):
            compiled.append(name)
    return tuple(compiled)


def extensions() -> str:
    """Which code runs the data plane: `compiled`, or pure Python because of
    TETHER_NO_EXTENSIONS=1 (`disabled`), because this install has no compiled modules
    (`not_built`), or because it has only some of them (`incomplete`: a build out of step
    with its sources)."""
    if len(compiled_modules()) == len(COMPILED_MODULES):
        return "compiled"
    if pure_forced():
        return "disabled"
    return "incomplete" if _built() else "not_built"
