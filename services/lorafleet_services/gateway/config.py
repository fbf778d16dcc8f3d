"""The gateway's own settings (beside the shared `lorafleet.settings.Settings`).

Every field is `LORAFLEET_GATEWAY_<FIELD>` in the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from lorafleet.settings import SettingsError, parse_host_port, read_env, write_env

#: The API keys file's name in the data directory (`lorafleet auth api-key`).
API_KEYS_FILE_NAME = "gateway-api-keys.json"


class GatewayConfigError(SettingsError):
    """A gateway setting lorafleet cannot use (the process exits 2 with one line)."""


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    """How the HTTP gateway works.

    addr: where it listens, "host:port" (port 0: a free one, logged on
        `service.started` as `url`); default 127.0.0.1:8090.
    engines: base URLs of OpenAI-compatible engines (vLLM's `/v1`), comma
        separated, that the completions are routed to by the models each
        lists (`GET <url>/models`), before the fleet's (the serving records
        and the nodes' heartbeats: fleet_model_location.py); default none (the
        fleet's only).
    engine_api_key: the Bearer key the engines want; default none.
    api_keys_file: the hashed API keys (`lorafleet auth api-key`); default
        `<data dir>/gateway-api-keys.json`.
    max_requests_per_key: requests one key may have in flight; one more is
        a 429; default 64.
    engine_models_ttl_s: seconds the engines' model lists (and the fleet's
        serving view) are reused before they are asked again (a model not
        found asks at once); default 2.
    max_jobs_in_flight_per_project: jobs (queued or on a node) one project
        may have; one more is a 429 (tenancy.py); default none (no quota).
    max_upload_bytes_per_project: bytes of files one project may keep; an
        upload past it is a 429; default none (no quota).
    adapter_load_wait_s: seconds a completion for a fine-tuned model whose
        adapter is being loaded waits for the load before its 404
        (adapter_wait.py); default 60.
    """

    addr: str = "127.0.0.1:8090"
    engines: tuple[str, ...] = ()
    engine_api_key: str | None = None
    api_keys_file: Path | None = None
    max_requests_per_key: int = 64
    engine_models_ttl_s: float = 2.0
    max_jobs_in_flight_per_project: int | None = None
    max_upload_bytes_per_project: int | None = None
    adapter_load_wait_s: float = 60.0

    def __post_init__(self) -> None:
        parse_host_port(self.addr, "LORAFLEET_GATEWAY_ADDR")
        for url in self.engines:
            if not url.startswith(("http://", "https://")):
                raise GatewayConfigError(
                    f"LORAFLEET_GATEWAY_ENGINES: {url!r} is not an http(s) URL: give each "
                    "engine's OpenAI base URL, e.g. http://127.0.0.1:8000/v1"
                )
        if self.max_requests_per_key < 1:
            raise GatewayConfigError("LORAFLEET_GATEWAY_MAX_REQUESTS_PER_KEY must be >= 1")
        if self.engine_models_ttl_s < 0:
            raise GatewayConfigError("LORAFLEET_GATEWAY_ENGINE_MODELS_TTL_S must be >= 0 seconds")
        if self.adapter_load_wait_s < 0:
            raise GatewayConfigError("LORAFLEET_GATEWAY_ADAPTER_LOAD_WAIT_S must be >= 0 seconds")
        for name in ("max_jobs_in_flight_per_project", "max_upload_bytes_per_project"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise GatewayConfigError(
                    f"LORAFLEET_GATEWAY_{name.upper()} must be >= 1 (unset: no quota)"
                )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
        """Read `LORAFLEET_GATEWAY_*`; `overrides` (not None) win over the environment."""
        env = os.environ if env is None else env
        values = read_env(cls, "LORAFLEET_GATEWAY_", env, GatewayConfigError)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def to_env(self) -> dict[str, str]:
        return write_env(self, "LORAFLEET_GATEWAY_")

    def keys_file(self, data_dir: str) -> Path:
        """Where the API keys are: `api_keys_file`, else in `data_dir`."""
        return self.api_keys_file or Path(data_dir) / API_KEYS_FILE_NAME

    def with_(self, **changes: Any) -> GatewayConfig:
        return replace(self, **changes)
