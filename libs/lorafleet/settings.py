"""One typed settings object for every lorafleet process, read from the environment.

Every field is `LORAFLEET_<FIELD>` in upper case (`LORAFLEET_NATS_URL`, ...).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from lorafleet.names import DEFAULT_PREFIX, Names

_INBOX_RE = re.compile(r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*$")


class SettingsError(ValueError):
    """An environment variable with a value lorafleet cannot use."""


def _default_data_dir() -> str:
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "lorafleet")


@dataclass(frozen=True, slots=True)
class Settings:
    """Settings shared by the services, the agent and the client."""

    #: NATS server URL(s), comma separated. Default nats://127.0.0.1:4222.
    nats_url: str = "nats://127.0.0.1:4222"
    #: A NATS credentials file (user JWT + seed), if the server wants one.
    nats_creds: str | None = None
    #: Prefix of this process's reply inboxes; default "_INBOX" (nats-py's).
    #: An agent whose credentials allow only its own subjects uses
    #: "_INBOX_<node>" (`lorafleet nats-config` prints it).
    nats_inbox_prefix: str = "_INBOX"
    #: Prefix of every subject, stream and bucket. Default "lorafleet".
    subject_prefix: str = DEFAULT_PREFIX
    #: SQLAlchemy URL of the system of record (postgresql+psycopg://... or
    #: sqlite+aiosqlite:///...). Default: SQLite under `data_dir`.
    database_url: str = ""
    #: Where the embedded default keeps its NATS store and database.
    data_dir: str = field(default_factory=_default_data_dir)
    #: Seconds between an agent's heartbeats; default 1.
    heartbeat_s: float = 1.0
    #: Seconds without a heartbeat after which a node is gone and its job
    #: fails; also the heartbeat's TTL in KV (whole seconds). Default 3.
    node_timeout_s: int = 3
    #: Seconds to wait for the first connection before failing; default 5.
    connect_timeout_s: float = 5.0
    #: Seconds a request waits for its reply; default 5.
    request_timeout_s: float = 5.0
    #: JetStream replicas for streams, KV and object stores (3 on a cluster).
    replicas: int = 1
    #: "debug", "info", "warning" or "error".
    log_level: str = "info"

    def __post_init__(self) -> None:
        Names(self.subject_prefix)  # validates the prefix
        if self.heartbeat_s <= 0:
            raise SettingsError("LORAFLEET_HEARTBEAT_S must be > 0 seconds")
        if self.node_timeout_s < 1:
            raise SettingsError("LORAFLEET_NODE_TIMEOUT_S must be >= 1 whole second")
        if self.node_timeout_s <= self.heartbeat_s:
            raise SettingsError(
                f"LORAFLEET_NODE_TIMEOUT_S ({self.node_timeout_s}) must exceed "
                f"LORAFLEET_HEARTBEAT_S ({self.heartbeat_s}), or every node looks lost"
            )
        if not _INBOX_RE.match(self.nats_inbox_prefix):
            raise SettingsError(
                f"LORAFLEET_NATS_INBOX_PREFIX={self.nats_inbox_prefix!r}: use dot-separated "
                "tokens of letters, digits, '-', '_' or '$' (no wildcards), e.g. _INBOX_node-1"
            )
        if self.replicas not in (1, 3, 5):
            raise SettingsError("LORAFLEET_REPLICAS must be 1, 3 or 5")

    @property
    def names(self) -> Names:
        return Names(self.subject_prefix)

    @property
    def effective_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{Path(self.data_dir) / 'lorafleet.db'}"

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read `LORAFLEET_*` variables; `overrides` (not None) win over the environment."""
        values = read_env(cls, "LORAFLEET_", os.environ if env is None else env, SettingsError)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)

    def with_(self, **changes: Any) -> Settings:
        return replace(self, **changes)

    def to_env(self) -> dict[str, str]:
        """These settings as `LORAFLEET_*` variables, for a child process."""
        return write_env(self, "LORAFLEET_")


def read_env(
    cls: Any, prefix: str, env: Mapping[str, str], error: type[ValueError]
) -> dict[str, Any]:
    """The dataclass fields of `cls` found in `env` as `<prefix><FIELD>`, typed.

    Types understood: str, str | None ("" is None), int, float, bool
    (1/true/yes/on), Path, tuple[str, ...] (comma separated). A value that
    does not parse raises `error` naming the variable.
    """
    values: dict[str, Any] = {}
    for f in fields(cls):
        key = f"{prefix}{f.name.upper()}"
        if key not in env:
            continue
        raw = env[key]
        kind = str(f.type)
        try:
            if kind == "bool":
                values[f.name] = raw.strip().lower() in ("1", "true", "yes", "on")
            elif kind == "float":
                values[f.name] = float(raw)
            elif kind == "int":
                values[f.name] = int(raw)
            elif kind == "Path":
                values[f.name] = Path(raw)
            elif kind.startswith("tuple"):
                values[f.name] = tuple(p.strip() for p in raw.split(",") if p.strip())
            elif "None" in kind:
                values[f.name] = raw or None
            else:
                values[f.name] = raw
        except ValueError:
            raise error(f"{key}={raw!r} is not a {kind}") from None
    return values


def write_env(obj: Any, prefix: str) -> dict[str, str]:
    """The inverse of `read_env`: each field not None as `<prefix><FIELD>`."""
    out: dict[str, str] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            continue
        out[f"{prefix}{f.name.upper()}"] = (
            ",".join(value) if isinstance(value, tuple) else str(value)
        )
    return out
