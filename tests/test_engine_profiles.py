"""Engine profiles: one module per engine in `proxy/engines/` says everything tether knows about
it, every module says all of it, and nothing elsewhere in `proxy/` knows an engine by name."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path
from typing import ClassVar, get_origin, get_type_hints

import pytest

import proxy
from bench.engine import ID_RULES
from proxy.engines import PROFILES, Engine, EngineProfile, engine_profile
from proxy.observe.metrics import route_label

from .support.settings import make_settings

pytestmark = pytest.mark.socket_free

# Settings each engine needs to start (generic has no abort call of its own).
NEEDS = {Engine.GENERIC: {"abort_url": "/abort/{internal_request_id}"}}
# The facts every engine's module states (declared, without a value, on the base).
FACTS = [
    name for name, hint in get_type_hints(EngineProfile).items() if get_origin(hint) is ClassVar
]


@pytest.mark.parametrize("engine", list(Engine))
def test_each_engine_module_states_a_complete_profile(engine: Engine) -> None:
    """`proxy/engines/<name>.py` holds the engine's `Profile`, which states every fact of
    its own (none inherited by accident) and builds from the settings."""
    profile_class = PROFILES[engine]
    assert profile_class.__module__ == f"proxy.engines.{engine.value}"
    assert not inspect.isabstract(profile_class)
    assert FACTS and [fact for fact in FACTS if fact not in vars(profile_class)] == []
    profile = engine_profile(make_settings(engine=engine, **NEEDS.get(engine, {})))
    assert profile.engine is engine
    for route in profile_class.routes:
        assert profile.route("POST", route.path) == route
    if profile.sends_aborts:
        [call, *_] = profile.abort_calls(("x" * 32,))
        assert call.url.startswith("http://127.0.0.1:9/") and "x" * 32 in repr(call)
    else:
        assert profile.abort_calls(("x" * 32,)) == ()


@pytest.mark.parametrize("engine", list(Engine))
def test_idle_upstream_connections_close_before_the_engines_own_keep_alive(
    engine: Engine,
) -> None:
    """uvicorn (vLLM's and SGLang's server) closes an idle connection after 5 s: tether's
    pool closes its own sooner, so no request goes out on one the engine is closing."""
    assert 0 < PROFILES[engine].keepalive_seconds < 5


def test_every_engines_routes_are_counted_under_their_own_label() -> None:
    """Each engine's generation and probe routes are metric labels of their own (TGI's
    /generate_stream and the Realtime API's /v1/realtime among them); other paths are
    `other`."""
    for profile in PROFILES.values():
        for path in profile.generation_routes | profile.probe_routes:
            assert route_label(path) == path
    assert route_label("/generate_stream/") == "/generate_stream"
    assert route_label("/v1/realtime") == "/v1/realtime"
    assert route_label("/v1/brand-new") == "other"


def test_the_benchmark_engine_names_requests_as_vllm_does() -> None:
    """bench/engine.py takes vLLM's IDs from tether's route table: `chatcmpl-<id>` for chat;
    `cmpl-<id>-0` to abort a completion, which answers as `cmpl-<id>`."""
    chat, completion = ID_RULES[b"/v1/chat/completions"], ID_RULES[b"/v1/completions"]
    assert (chat.engine_request_id("x"), chat.answer("x")) == ("chatcmpl-x", "chatcmpl-x")
    assert (completion.engine_request_id("x"), completion.answer("x")) == ("cmpl-x-0", "cmpl-x")


# --- nothing outside proxy/engines/ names an engine ------------------------------------------

ENGINE_NAMES = {engine.value for engine in Engine}
# `generic`, `none` and `auto` are ordinary words too (`None`, `TokenShape.NONE`,
# TETHER_WORKERS=auto): they count only as a value compared with (`engine == "none"`); the
# other names count anywhere in code.
DISTINCT_NAMES = ENGINE_NAMES - {"generic", "none", "auto"}


def _docstrings(tree: ast.Module) -> set[int]:
    """The ids of the nodes that are docstrings (prose, which may name engines)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                found.add(id(body[0].value))
    return found


def _identifiers(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        return [node.attr]
    if isinstance(node, ast.alias):
        return [node.name, node.asname or ""]
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.arg):
        return [node.arg]
    if isinstance(node, ast.keyword):
        return [node.arg or ""]
    return []


def _engine_mentions(source: str) -> list[str]:
    """Where code (not comments, docstrings or prose) names an engine."""
    tree = ast.parse(source)
    docstrings = _docstrings(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        for name in _identifiers(node):
            if any(engine in name.lower() for engine in DISTINCT_NAMES):
                found.append(f"line {line}: {name}")
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "Engine":
                found.append(f"line {line}: Engine.{node.attr}")
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module.rpartition(".")[2] in ENGINE_NAMES or (
                module.endswith("engines") and {a.name for a in node.names} & ENGINE_NAMES
            ):
                found.append(f"line {line}: imports an engine's module")
        if isinstance(node, ast.Compare):
            for operand in _flattened([node.left, *node.comparators]):
                value = operand.value if isinstance(operand, ast.Constant) else None
                if isinstance(value, str) and value.lower() in ENGINE_NAMES:
                    found.append(f"line {line}: compared with {value!r}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            text: str = node.value
            if id(node) in docstrings or any(space in text for space in " \n"):
                continue  # prose: a docstring, a message, a setting's description
            if any(engine in text.lower() for engine in DISTINCT_NAMES):
                found.append(f"line {line}: {text!r}")
    return found


def _flattened(nodes: list[ast.expr]) -> list[ast.expr]:
    """The operands of a comparison, the items of a tuple, list or set among them included."""
    flat: list[ast.expr] = []
    for node in nodes:
        if isinstance(node, ast.Tuple | ast.List | ast.Set):
            flat.extend(node.elts)
        else:
            flat.append(node)
    return flat


def test_the_checker_finds_what_it_looks_for() -> None:
    """The check below would see an engine named in code: in an identifier, an enum member,
    a string value, an import; never in comments or prose."""
    code = (
        '"""vLLM\'s docs."""\n'
        "from .engines import vllm\n"
        "from .engines.none import Profile\n"
        "x = Engine.NONE  # sglang\n"
        "SGLANG_GENERATE = 1\n"
        'if engine in ("generic", "x"): pass\n'
        'y = "X-sglang-Rid"\n'
        'z = "tether waits for vLLM and SGLang to end it"\n'
    )
    lines = {mention.split(":")[0] for mention in _engine_mentions(code)}
    assert lines == {f"line {number}" for number in range(2, 8)}


def test_no_module_outside_the_engines_package_names_an_engine() -> None:
    """Engine knowledge lives in proxy/engines/ alone: elsewhere in proxy/ no code names an
    engine (comments and prose may, as examples)."""
    root = Path(proxy.__file__).parent
    found = {
        str(path.relative_to(root)): mentions
        for path in sorted(root.rglob("*.py"))
        if path.parent.name != "engines" and (mentions := _engine_mentions(path.read_text()))
    }
    assert found == {}
