"""A JSON body's members are read as json.loads reads them and set everywhere they are
written, without decoding what tether does not read; what that costs is bounded."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.wire.json_members import (
    DECODED_WHOLE,
    MAX_MEMBERS,
    MAX_TOKENS,
    InvalidJsonBody,
    JsonBodyTooComplex,
    JsonMembers,
    JsonObject,
)

# --- documents as clients write them ----------------------------------------------------------

# Names that collide (duplicates), that tether reads, that need escapes or are not ASCII.
_NAMES = st.sampled_from(["rid", "n", "stream", "model", "a", "", "é", 'q"', "\\", "\U0001f600"])
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats()  # NaN and the infinities are written NaN, Infinity, -Infinity
    | st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)
)
_VALUES = st.recursive(
    _SCALARS,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(_NAMES | st.text(max_size=4), children, max_size=4)
    ),
    max_leaves=12,
)
_SPACES = st.sampled_from(["", " ", "\n", "\t", "\r\n  ", "        "])
_ENCODINGS = st.sampled_from(
    ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le"]
)


def _spelled(name: str, escaped: bool) -> str:
    """`name` as a JSON string, each character a `\\u` escape where `escaped`."""
    if not escaped:
        return json.dumps(name, ensure_ascii=False)
    units = name.encode("utf-16-be", "surrogatepass")
    return '"' + "".join(f"\\u{units[i : i + 2].hex()}" for i in range(0, len(units), 2)) + '"'


@dataclass(frozen=True)
class Document:
    """A JSON object as a client wrote it: its text in an encoding, and the names in it."""

    text: str
    encoding: str
    names: list[str]

    def body(self, scanned: bool) -> bytes:
        """The body; `scanned`: made larger than DECODED_WHOLE (trailing whitespace), so that
        its members are located instead of decoded whole."""
        padding = " " * (DECODED_WHOLE + 1) if scanned else ""
        return (self.text + padding).encode(self.encoding, "surrogatepass")


@st.composite
def documents(draw: st.DrawFn) -> Document:
    """A JSON object as a client might write it: names repeated or spelled with escapes, any
    spacing, values nested and in any spelling json.dumps has, any encoding json.loads
    detects."""
    members = draw(st.lists(st.tuples(_NAMES, _VALUES), max_size=8))
    pieces = []
    for name, value in members:
        space = draw(_SPACES)
        value_text = json.dumps(
            value,
            ensure_ascii=draw(st.booleans()),
            indent=draw(st.sampled_from([None, 1])),
            separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])),
        )
        pieces.append(
            f"{space}{_spelled(name, draw(st.booleans()))}{draw(_SPACES)}:{space}{value_text}"
        )
    text = draw(_SPACES) + "{" + ",".join(pieces) + draw(_SPACES) + "}" + draw(_SPACES)
    return Document(text, draw(_ENCODINGS), [name for name, _ in members])


def _same(read: Any, expected: Any) -> bool:
    """Equal as JSON values (NaN equals NaN)."""
    return json.dumps(read, sort_keys=True) == json.dumps(expected, sort_keys=True)


def _read_as(document: JsonMembers, name: str, expected: Any) -> None:
    """The member reads as `expected`, json.loads' value, through every reading there is."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    assert document.kind(name) == kinds.get(type(expected), "number")
    assert document.truthy(name) == bool(expected)
    if isinstance(expected, dict):
        inner = document.object(name, [*expected, "absent"])
        assert inner is not None and "absent" not in inner
        for key, value in expected.items():
            _read_as(inner, key, value)
        return
    assert document.object(name, ["x"]) is None
    array = document.array(name)
    if isinstance(expected, list):
        assert array is not None and array.length == len(expected)
        first = expected[0] if expected else None
        assert _same(array.first, first if not isinstance(first, str | list | dict) else None)
        assert document.scalar(name) is None
    else:
        assert array is None
        assert _same(document.scalar(name), expected)


# --- reading ------------------------------------------------------------------------------------


@settings(max_examples=300)
@given(documents(), st.booleans())
def test_members_read_as_json_loads_reads_them(document: Document, scanned: bool) -> None:
    """Whatever the document, decoded whole or scanned: every member json.loads finds is
    found with json.loads' value (its last occurrence, names decoded), and no other."""
    body = document.body(scanned)
    expected = json.loads(body)
    names = [*document.names, "absent", "rid"]
    read = JsonObject(body, names)
    for name in names:
        assert (name in read) == (name in expected)
        if name in expected:
            _read_as(read, name, expected[name])


def _first_wins(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object as a parser that keeps a name's first occurrence reads it."""
    result: dict[str, Any] = {}
    for name, value in pairs:
        result.setdefault(name, value)
    return result


_SETTABLE = st.sampled_from(["rid", "n", "model", "é", "new", "rid.x", "a.rid", "a.b.c"])


def _set(holder: dict[str, Any], path: list[str], value: Any) -> None:
    """Decode-edit-encode's edit: the member at `path`, each object on the way made one if
    it is not."""
    for name in path[:-1]:
        inner = holder.get(name)
        holder[name] = inner = dict(inner) if isinstance(inner, dict) else {}
        holder = inner
    holder[path[-1]] = value


def _at(holder: Any, path: list[str]) -> Any:
    for name in path:
        holder = holder[name]
    return holder


@settings(max_examples=300)
@given(
    documents(),
    st.booleans(),
    st.dictionaries(_SETTABLE, _VALUES, max_size=3).filter(
        lambda values: not any(name.startswith(other + ".") for name in values for other in values)
    ),
)
def test_setting_members_is_what_decode_edit_encode_would_give(
    document: Document, scanned: bool, values: dict[str, Any]
) -> None:
    """After setting some members, the body reads (json.loads) as the decoded object with
    those members set (a dotted name inside its object member); and a parser that keeps a
    name's first occurrence reads the same values: every occurrence was set."""
    body = document.body(scanned)
    expected = json.loads(body)
    for name, value in values.items():
        _set(expected, name.split("."), value)
    read = JsonObject(body, [name.partition(".")[0] for name in values])

    edited = read.with_members(values)

    assert _same(json.loads(edited.decode("utf-8", "surrogatepass")), expected)
    first = json.loads(edited, object_pairs_hook=_first_wins)
    for name, value in values.items():
        assert _same(_at(first, name.split(".")), value)


@settings(max_examples=500)
@given(documents(), st.booleans(), st.data())
def test_a_damaged_body_is_refused_or_read_as_json_loads_reads_it(
    document: Document, scanned: bool, data: st.DataObject
) -> None:
    """A body with bytes changed, cut or added is refused (InvalidJsonBody), or, where
    json.loads still reads it, read the same way: never an error of another kind, never a
    member json.loads would not find."""
    body = document.body(scanned)
    at = data.draw(st.integers(min_value=0, max_value=len(document.body(scanned=False))))
    cut = data.draw(st.integers(min_value=0, max_value=3))
    added = data.draw(st.binary(max_size=3) | st.sampled_from([b'"', b"\\", b"[", b"}", b","]))
    damaged = body[:at] + added + body[at + cut :]
    names = [*document.names, "rid"]
    try:
        read = JsonObject(damaged, names)
    except InvalidJsonBody:
        return
    try:
        expected = json.loads(damaged)
    except (ValueError, RecursionError):
        return  # json.loads refuses it: the engine's parser rejects what tether skipped
    assert isinstance(expected, dict)
    for name in names:
        assert (name in read) == (name in expected)
        if name in expected:
            _read_as(read, name, expected[name])


# --- what reading costs -------------------------------------------------------------------------


def test_a_body_of_tiny_containers_is_refused_past_the_token_limit() -> None:
    """Past MAX_TOKENS strings, arrays and objects the body is refused, however they nest."""
    for unit in (b"{},", b"[],", b'"",'):
        body = b'{"messages": [' + unit * MAX_TOKENS + b"{}]}"
        with pytest.raises(JsonBodyTooComplex, match="strings, arrays and objects"):
            JsonObject(body, ["model"])
    deep = b'{"messages": ' + b"[" * (MAX_TOKENS + 1) + b"]" * (MAX_TOKENS + 1) + b"}"
    with pytest.raises(JsonBodyTooComplex):
        JsonObject(deep, ["model"])


def test_a_body_of_max_tokens_is_read_and_one_more_refused() -> None:
    """A body of MAX_TOKENS strings, arrays and objects (names and the body's own object
    included) is read, its list counted without being built; one more is refused."""
    inner = MAX_TOKENS - 5  # the object, "prompt", its list, "model", "m"
    body = b'{"prompt": [' + b"[]," * (inner - 1) + b'[]], "model": "m"}'
    read = JsonObject(body, ["prompt", "model"])
    array = read.array("prompt")
    assert array is not None and array.length == inner
    assert read.scalar("model") == "m"
    with pytest.raises(JsonBodyTooComplex):
        JsonObject(body.replace(b"[[]", b"[[],[]", 1), ["prompt"])


@pytest.mark.parametrize("depth", [2_000, 100_000])
def test_nesting_deeper_than_json_loads_reads_is_walked_without_recursion(depth: int) -> None:
    """A member nested deeper than json.loads can recurse (it fails) is skipped by depth,
    in a small body as in a large one."""
    body = b'{"a": ' + b"[" * depth + b"]" * depth + b', "rid": "x"}'
    assert JsonObject(body, ["rid"]).scalar("rid") == "x"
    with pytest.raises(InvalidJsonBody):
        JsonObject(body + b" {}", ["rid"])


def _scanned(body: bytes) -> bytes:
    """`body` made larger than DECODED_WHOLE (trailing whitespace): scanned, not decoded."""
    return body + b" " * (DECODED_WHOLE + 1)


def test_an_object_tether_scans_has_at_most_max_members() -> None:
    """A body too large to decode whole with more members than MAX_MEMBERS is refused."""
    body = _scanned(b"{" + b'"a": 1, ' * MAX_MEMBERS + b'"b": 2}')
    with pytest.raises(JsonBodyTooComplex, match="members"):
        JsonObject(body, ["b"])
    assert JsonObject(body.replace(b', "b": 2}', b"}"), ["a"]).scalar("a") == 1


@pytest.mark.parametrize("scanned", [False, True])
@pytest.mark.parametrize(
    ("value", "length", "first"),
    [
        (b"[]", 0, None),
        (b"[1, 2, 3]", 3, 1),
        (b'["a", "b,c", ["d", "e"], {"f": [1, 2]}]', 4, None),
        (b"[ true ]", 1, True),
        (b"[-1.5e3, 2]", 2, -1500.0),
        (b"[NaN,\n 1]", 2, float("nan")),
    ],
)
def test_an_array_is_counted_and_its_first_number_read(
    value: bytes, length: int, first: Any, scanned: bool
) -> None:
    """An array member's items are counted at its own level, and its first item decoded
    where it is a number or a literal."""
    body = b'{"prompt": ' + value + b"}"
    read = JsonObject(_scanned(body) if scanned else body, ["prompt"])
    array = read.array("prompt")
    assert array is not None and array.length == length
    assert _same(array.first, first)


@pytest.mark.parametrize(
    "body",
    [
        b'{"a": [1, 2}',  # never ends
        b'{"a": "never ends}',
        b"{\"a\": 'single'}",  # a byte JSON never has outside a string
        b'{"a": 1,}',
        b'{"a" 1}',
        b'{"a": }',
        b'{"a": tru}',
        b'{"a": 01}',
        b'{"\\x": 1}',  # a bad escape in a name
        b'{"a": "\xff"}',  # not UTF-8
        b"{} {}",
    ],
)
def test_what_the_scan_can_tell_is_not_json_is_refused(body: bytes) -> None:
    """Invalid where the scan looks (the body's encoding, the object's own structure, bytes
    outside strings, the ends of strings and brackets, the members it reads): refused as
    json.loads refuses it."""
    with pytest.raises(ValueError):
        json.loads(body)
    with pytest.raises(InvalidJsonBody):
        JsonObject(_scanned(body), ["a"]).scalar("a")


def test_a_long_string_full_of_escapes_ends_where_json_loads_ends_it() -> None:
    """Escaped quotes and backslashes, in windows of any alignment, never end a string."""
    for run in (1, 2, 3, 4):
        content = ("x" * 5000 + "\\" * run + '"' + "\\\\" * 3000 + "y") * 25
        body = json.dumps({"prompt": content, "rid": "client"}).encode()
        assert len(body) > DECODED_WHOLE
        read = JsonObject(body, ["prompt", "rid"])
        assert read.scalar("prompt") == content
        assert read.scalar("rid") == "client"
