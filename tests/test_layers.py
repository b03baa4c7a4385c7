"""The package's structure, checked rather than only written: no import circle between modules
(imports only a type checker sees included), no arrow from a lower layer to a higher one, no
package `__init__` with code but the engines' registry, and no compiled coroutine that
suspends inside an `except` clause. The layers are named once, here, top-down; docs/hooks.py
builds docs/architecture.md's table of them from `LAYERS`."""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

import proxy
from proxy.compiled import COMPILED_MODULES

pytestmark = pytest.mark.socket_free

ROOT = Path(proxy.__file__).parent

# Top-down. A module may import from its own layer (without a circle) and from any below.
LAYERS: tuple[tuple[str, str], ...] = (
    ("proxy.__main__", "`tether`: read settings, configure logging, start one process or workers"),
    ("proxy.workers", "TETHER_WORKERS > 1: the supervisor, its admin port, the workers"),
    ("proxy.server", "one process: its servers, the request's life (handler), admin, readiness"),
    ("proxy.aborts", "stopping the engine's work and proving it stopped"),
    ("proxy.request", "one request's record, body, registry, accounting, WebSocket"),
    ("proxy.upstream", "the engine connection: pool, HTTP/1.1 state machine, exchange, relay"),
    ("proxy.wire", "pure: headers, paths, IDs, JSON members, token counting, usage events"),
    ("proxy.observe", "metrics, logging, tracing"),
    ("proxy.settings", "every TETHER_* setting"),
    ("proxy.engines", "everything tether knows about each engine"),
    ("proxy.errors", "the error hierarchy and the one status table"),
    ("proxy.outcomes", "how a request ended and where it was: the labels of logs and metrics"),
    ("proxy.faults", "the named points where a test may make tether fail"),
    ("proxy", "the package: its version; the pure-Python switch installed at import"),
    ("proxy.compiled", "which modules are compiled, and the switch back to pure Python"),
)


def layer_of(module: str) -> int:
    """The index of the layer `module` belongs to (its longest prefix in LAYERS)."""
    best = max(
        (name for name, _ in LAYERS if module == name or module.startswith(name + ".")),
        key=len,
    )
    return [name for name, _ in LAYERS].index(best)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path, root: Path = ROOT) -> Iterator[tuple[int, str]]:
    """(line, module) for every module of the package at `root` that `path` imports, at run
    time or only for the type checker."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]

    def is_module(name: str) -> bool:
        where = root.parent.joinpath(*name.split("."))
        return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "proxy":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "proxy":
                continue
            for alias in node.names:
                child = f"{target}.{alias.name}"
                yield node.lineno, child if is_module(child) else target


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        graph[module] = {target for _, target in imports(path, root) if target != module}
    return graph


def upward_arrows(root: Path = ROOT) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        module = _module_name(path, root)
        for line, target in imports(path, root):
            if layer_of(target) < layer_of(module):
                found.append(f"{module}:{line} imports {target}, a layer above it")
    return found


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    """Dependencies point down the table: an arrow up (a type-only import included) fails."""
    assert upward_arrows() == []


def test_no_import_circle() -> None:
    """No two modules import each other, directly or through others, type-only included."""
    assert cycles(import_graph()) == []


def test_every_module_has_a_layer() -> None:
    """Each module of the package falls under one of the named layers."""
    assert all(layer_of(module) >= 0 for module in import_graph())


def test_package_inits_are_empty_but_the_engines_registry() -> None:
    """A subpackage's `__init__` holds nothing, so importing one module loads none of its
    siblings; only `engines/`'s holds code: the registry of engines."""
    assert [
        str(path.relative_to(ROOT))
        for path in sorted(ROOT.glob("*/__init__.py"))
        if path.parent.name != "engines" and path.read_text().strip()
    ] == []


def _source(module: str) -> str:
    return (ROOT.parent / f"{module.replace('.', '/')}.py").read_text()


def suspensions_in_except(source: str) -> list[int]:
    """The lines of every `await`, `async for` and `async with` inside an `except` clause."""
    return sorted(
        inner.lineno
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ExceptHandler)
        for inner in ast.walk(node)
        if isinstance(inner, ast.Await | ast.AsyncFor | ast.AsyncWith)
    )


def test_no_compiled_coroutine_suspends_inside_an_except_clause() -> None:
    """mypyc keeps the exception being handled as the thread's own while a compiled coroutine
    is suspended inside its `except` clause, so whatever else the loop runs meanwhile sees it
    as the exception being handled (a missing move once read as an engine's protocol error):
    compiled modules await after their `except` clauses, never inside one."""
    found = {
        module: lines
        for module in COMPILED_MODULES
        if (lines := suspensions_in_except(_source(module)))
    }
    assert found == {}


def exceptions_named_alike(source: str) -> list[str]:
    """`line: name` of every `except ... as name` in a function that binds the same name to
    another exception type in another clause."""
    found = []
    for function in ast.walk(ast.parse(source)):
        if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        caught: dict[str, str] = {}
        for node in ast.walk(function):
            if isinstance(node, ast.ExceptHandler) and node.name and node.type is not None:
                kind = ast.unparse(node.type)
                if caught.setdefault(node.name, kind) != kind:
                    found.append(f"{node.lineno}: {node.name}")
    return found


def test_no_compiled_function_names_two_caught_exception_types_alike() -> None:
    """Compiled, one name in a function is one variable of one type: `except A as exc` then
    `except B as exc` fails with a TypeError when B is caught (a bad body once answered 500
    instead of 400 this way). Each clause names its exception apart."""
    found = {
        module: names
        for module in COMPILED_MODULES
        if (names := exceptions_named_alike(_source(module)))
    }
    assert found == {}


def test_the_naming_check_finds_two_types_under_one_name() -> None:
    source = (
        "def f():\n"
        "    try:\n"
        "        g()\n"
        "    except KeyError as exc:\n"
        "        pass\n"
        "    except ValueError as exc:\n"
        "        pass\n"
        "    except ValueError as other:\n"
        "        pass\n"
    )
    assert exceptions_named_alike(source) == ["6: exc"]


def test_the_suspension_check_finds_an_await_in_an_except_clause() -> None:
    source = (
        "async def f():\n"
        "    try:\n"
        "        await g()\n"
        "    except OSError:\n"
        "        async with h():\n"
        "            await g()\n"
    )
    assert suspensions_in_except(source) == [5, 6]


def test_the_checks_find_a_circle_and_an_arrow_up(tmp_path: Path) -> None:
    """The checks see what they look for, in a package laid out like tether's: a circle
    through a type-only import, and a lower layer importing a higher one."""
    package = tmp_path / "proxy"
    for directory in (package / "wire", package / "server"):
        directory.mkdir(parents=True)
        (directory / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "wire" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import b\n"
    )
    (package / "wire" / "b.py").write_text("from .a import x\nfrom ..server import c\n")
    (package / "server" / "c.py").write_text("")
    assert cycles(import_graph(package)) == [["proxy.wire.a", "proxy.wire.b"]]
    assert upward_arrows(package) == ["proxy.wire.b:2 imports proxy.server.c, a layer above it"]
