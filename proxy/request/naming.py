"""What a request is called: the client's own ID (its header, or the name its body gives the
request), the ID the engine runs it under (a fresh one of tether's, or in preserve mode the
client's), and which of them the client gets back where the engine would write its own.

Every ID a client chooses obeys one rule (visible ASCII, at most 256 characters) whichever
wins, since engines write it into every event of a stream; in preserve mode the engine keys
its state by it, so none may be in flight twice, nor (where the engine aborts by prefix)
be a prefix of another in flight."""

from __future__ import annotations

from collections.abc import Mapping

from ..engines import EngineProfile
from ..errors import DuplicateRequestIdError, InvalidRequestIdError, OverlappingRequestIdError
from ..observe.logging import bind_request_ids
from ..wire.ids import IdMinter, InvalidClientRequestId, check_client_request_id
from .registry import Registry
from .state import RequestState

# Fresh IDs tried for a request without one in preserve mode before it is refused: each is
# refused only where an in-flight client ID is a prefix of it (1 in 16 per one-character ID).
_MINT_TRIES = 4


def header_request_id(headers: Mapping[str, str], header: str) -> str | None:
    """The client's ID from its request-ID header, None without one; 400 for one unfit to
    log or echo."""
    value = headers.get(header)
    if value is None:
        return None
    try:
        return check_client_request_id(value)
    except InvalidClientRequestId as exc:
        raise InvalidRequestIdError(f"the {header} header {exc}") from None


def preserved_id(
    registry: Registry, ids: IdMinter, engine: EngineProfile, client_request_id: str | None
) -> str:
    """Preserve mode: the engine runs the client's own ID, or one tether mints where it sent
    none; neither may be in flight already, or (for an engine that aborts by prefix) be a
    prefix of one in flight or start with one."""
    if client_request_id is not None:
        refuse_in_flight(registry, engine, client_request_id)
        return client_request_id
    for _ in range(_MINT_TRIES - 1):
        minted = ids.mint()
        if not (engine.aborts_by_prefix and registry.prefix_related(minted)):
            return minted
    minted = ids.mint()
    refuse_in_flight(registry, engine, minted)
    return minted


def refuse_in_flight(
    registry: Registry, engine: EngineProfile, request_id: str, ignoring: str | None = None
) -> None:
    """Preserve mode: an ID the engine would run a second time is refused (409), and so,
    where the engine aborts by prefix (SGLang), is one whose abort would stop another
    request or be stopped by another's."""
    if registry.find(request_id):
        raise DuplicateRequestIdError(
            f"a request with the ID {request_id!r} is already in flight "
            "(TETHER_REQUEST_ID_MODE=preserve passes IDs to the engine unchanged, so each "
            "must be unique while it runs)"
        )
    if not engine.aborts_by_prefix:
        return
    related = registry.prefix_related(request_id, ignoring)
    if related is not None:
        shorter, longer = sorted((request_id, related), key=len)
        raise OverlappingRequestIdError(
            f"the ID {request_id!r} overlaps one already in flight: {shorter!r} is a prefix of "
            f"{longer!r}, and this engine aborts every request whose ID starts with the one "
            "named (TETHER_REQUEST_ID_MODE=preserve passes IDs to the engine unchanged, so "
            "those in flight must not be prefixes of one another)"
        )


def preserving(state: RequestState) -> bool:
    """Whether the engine gets the client's own IDs (TETHER_REQUEST_ID_MODE=preserve)."""
    return state.internal_request_id == state.client_request_id


def adopt_body_id(registry: Registry, state: RequestState, body_id: str) -> None:
    """A client that named its request in the body (vLLM's `request_id`, SGLang's `rid`)
    gets that name back wherever the engine would have written it into its answer: without
    a header ID it is the request's client ID (logs, the response header, the admin API; in
    preserve mode the engine's ID too, in its ID headers), with one it is the engine's choice
    which wins. (A 4 MB name and 100 tokens made 424 MB on vLLM 0.32: the name obeys the
    header ID's rule whichever wins.)"""
    try:
        check_client_request_id(body_id)
    except InvalidClientRequestId as exc:
        assert state.route is not None and state.route.client_id_field is not None
        field = state.route.client_id_field.name
        raise InvalidRequestIdError(f"the body's {field} {exc}") from None
    engine = state.engine
    if state.id_in_header:
        if engine.body_id_beats_header:
            state.echo_id = body_id
        return
    kept = preserving(state)
    if kept:  # the request's own ID (tether's, minted) is about to be replaced
        refuse_in_flight(registry, engine, body_id, ignoring=state.internal_request_id)
    internal_request_id = body_id if kept else state.internal_request_id
    registry.rename(state, body_id, internal_request_id)
    bind_request_ids(body_id, internal_request_id)
