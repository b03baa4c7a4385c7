"""tether: a sidecar that aborts abandoned LLM requests upstream and keeps request IDs unique."""

__version__ = "0.1.0"
