"""Settings for in-process tethers, built from arguments only: the test machine's environment
and .env never leak into a test."""

from __future__ import annotations

from typing import Any, Protocol

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from proxy.settings import Settings


class IsolatedSettings(Settings):
    """Settings built from arguments only: the test machine's environment and .env are ignored."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def make_settings(**overrides: Any) -> Settings:
    """Test defaults (loopback, free ports, no grace, fast health checks, no repeated abort)
    with `overrides` on top."""
    values: dict[str, Any] = {
        "upstream_url": "http://127.0.0.1:9",
        "host": "127.0.0.1",
        "port": 0,
        "admin_host": "127.0.0.1",
        "admin_port": 0,
        "shutdown_grace": 0,
        "health_interval": 0.05,
        "abort_repeat_delay": 0,
    }
    values.update(overrides)
    return IsolatedSettings(**values)


class SettingsFactory(Protocol):
    """The `settings` fixture: `make_settings`."""

    def __call__(self, **overrides: Any) -> Settings: ...
