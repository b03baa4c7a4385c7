"""A serving process's start, the same in `tether` (one process or the supervisor) and in
each of the supervisor's workers: the settings read from the environment (a bad one named,
exit 2), tracing checked, logging configured, prometheus-client's `*_created` series off."""

from __future__ import annotations

import sys

import prometheus_client
from pydantic import ValidationError

from ..observe.logging import configure_logging
from ..observe.tracing import TracingUnavailableError
from ..observe.tracing import check_available as check_tracing
from ..settings import Settings, describe_errors


def boot(who: str, *, worker: int | None = None) -> Settings | None:
    """The settings this process serves with, its logging configured; None after saying on
    stderr, as `who`, why it cannot start (the caller exits 2)."""
    try:
        settings = Settings()  # type: ignore[call-arg]  # fields come from the environment
        check_tracing(settings.tracing)
    except ValidationError as error:
        print(f"{who}: invalid configuration:", file=sys.stderr)
        for line in describe_errors(error):
            print(f"  {line}", file=sys.stderr)
        return None
    except TracingUnavailableError as error:
        print(f"{who}: invalid configuration:\n  {error}", file=sys.stderr)
        return None
    configure_logging(
        settings.log_format, settings.log_level, settings.secret_values(), worker=worker
    )
    # `*_created` series double the exposition for no use in Prometheus queries.
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    return settings
