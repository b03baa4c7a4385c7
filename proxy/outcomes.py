"""How a request ended, where it was when it did, and how stopping its engine work ended:
the values logs and metric labels use as they are. A leaf: every layer names them, none
needs more of a request to do so."""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    """Where a request is in its life; also the `phase` label of disconnect metrics."""

    BODY = "body"  # reading the client's body (and sending it upstream)
    # read, waiting in tether for a free engine slot (TETHER_ENGINE_SLOTS); never sent
    QUEUED = "queued"
    WAITING = "waiting"  # body sent, waiting for the engine's response (queued, prefill)
    STREAMING = "streaming"  # relaying the response to the client


class Outcome(StrEnum):
    """How a request ended; used as-is in logs and metric labels."""

    COMPLETED = "completed"
    REJECTED = "rejected"
    CLIENT_DISCONNECTED = "client_disconnected"
    ADMIN_ABORTED = "admin_aborted"
    CANCELLED = "cancelled"  # its caller cancelled it by ID (POST /v1/requests/{id}/cancel)
    SHUTDOWN_ABORTED = "shutdown_aborted"
    TIMED_OUT = "timed_out"
    UPSTREAM_FAILED = "upstream_failed"
    INTERNAL_ERROR = "internal_error"


class AbortResult(StrEnum):
    """How stopping the engine's work for a request ended; the `result` of abort metrics."""

    CONFIRMED = "confirmed"  # the engine ended the response within the confirm window
    UNCONFIRMED = "unconfirmed"  # the call was accepted, the response went on: dropped
    DROPPED = "dropped"  # the call was accepted; dropped at once (a front end that misses)
    NOT_SUPPORTED = "not_supported"  # the engine has no abort route: dropped
    UNKNOWN_ROUTE = "unknown_route"  # tether cannot name the engine's ID here: dropped
    FAILED = "failed"  # the call failed (deadline, errors, refused): dropped
