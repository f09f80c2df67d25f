"""The plugin's environment, read once and validated: a bad value is an error naming the variable.

The plugin runs inside vLLM's process, configured only through these variables (see
docs/control-api.md). ``PluginEnv.read()`` turns them into one typed object at start-up, so the
engine either starts with a valid configuration or refuses with a message such as
``TAILPILOT_API_PORT='abc': expected an integer port (negative disables the API)``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from scheduler.errors import TailpilotError
from scheduler.plugin.tenancy import TenantIdentity

DEFAULT_PORT = 8765
TOKEN_ENV, TOKEN_FILE_ENV = "TAILPILOT_TOKEN", "TAILPILOT_TOKEN_FILE"
HOST_ENV, PORT_ENV = "TAILPILOT_API_HOST", "TAILPILOT_API_PORT"
REPLICA_ENV = "TAILPILOT_REPLICA"
SETTINGS_FILE_ENV = "TAILPILOT_SETTINGS_FILE"
TENANT_SOURCE_ENV, TENANT_KEY_FILE_ENV = "TAILPILOT_TENANT_SOURCE", "TAILPILOT_TENANT_KEY_FILE"

# field -> (variable, what a valid value is)
VARIABLES = {
    "token": (TOKEN_ENV, "the write token"),
    "token_file": (TOKEN_FILE_ENV, "a file holding the write token"),
    "api_host": (HOST_ENV, "the address the control API binds"),
    "api_port": (PORT_ENV, "an integer port (0: any free port; negative disables the API)"),
    "replica": (REPLICA_ENV, "a non-empty replica name"),
    "settings_file": (SETTINGS_FILE_ENV, "a settings JSON file"),
    "tenant_source": (TENANT_SOURCE_ENV, "client, gateway or none (who may name a tenant)"),
    "tenant_key_file": (TENANT_KEY_FILE_ENV, "a file holding the gateway's signing key"),
}


class PluginEnvError(TailpilotError, ValueError):
    """A TAILPILOT_* variable with a value the plugin cannot use."""


class PluginEnv(BaseModel):
    """Every TAILPILOT_* variable the plugin reads (unset: the default)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    token: str | None = None
    token_file: Path | None = None
    api_host: str = Field("127.0.0.1", min_length=1)
    api_port: int = Field(DEFAULT_PORT, le=65_535)
    replica: str = Field("replica", min_length=1, max_length=200)
    settings_file: Path | None = None
    tenant_source: Literal["client", "gateway", "none"] = "client"
    tenant_key_file: Path | None = None

    @field_validator("token", mode="before")
    @classmethod
    def _blank_is_none(cls, v: object) -> object:
        # An empty or whitespace-only token is no token: writes stay refused.
        return (v.strip() or None) if isinstance(v, str) else v

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> PluginEnv:
        """The plugin's configuration from ``environ`` (default ``os.environ``)."""
        environ = os.environ if environ is None else environ
        raw = {
            name: environ[var].strip() if name != "token" else environ[var]
            for name, (var, _) in VARIABLES.items()
            if var in environ
        }
        raw = {k: v for k, v in raw.items() if v != "" or k == "token"}
        try:
            return cls.model_validate(raw)
        except ValidationError as err:
            first = err.errors()[0]
            name = str(first["loc"][0]) if first["loc"] else "?"
            var, expected = VARIABLES.get(name, (name, "a valid value"))
            raise PluginEnvError(f"{var}={raw.get(name)!r}: expected {expected}") from None

    def identity(self) -> TenantIdentity:
        """Where a request's tenant comes from (``scheduler.plugin.tenancy``); gateway mode
        without a readable, non-empty key refuses to start, naming the variable."""
        if self.tenant_source != "gateway":
            return TenantIdentity(self.tenant_source)
        path = self.tenant_key_file
        if path is None:
            raise PluginEnvError(
                f"{TENANT_SOURCE_ENV}=gateway needs {TENANT_KEY_FILE_ENV}: the file holding the "
                "key the gateway signs tenant labels with"
            )
        try:
            key = path.read_bytes().strip()
        except OSError as err:
            raise PluginEnvError(
                f"{TENANT_KEY_FILE_ENV}={str(path)!r}: cannot read ({err.strerror or err})"
            ) from None
        if not key:
            raise PluginEnvError(f"{TENANT_KEY_FILE_ENV}={str(path)!r}: the key file is empty")
        return TenantIdentity("gateway", key)
