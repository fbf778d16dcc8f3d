"""One typed settings object for every lorafleet process, read from the environment.

Every field is `LORAFLEET_<FIELD>` in upper case (`LORAFLEET_NATS_URL`, ...).
"""

from __future__ import annotations

import os
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect as mi

from lorafleet.names import DEFAULT_PREFIX, Names

_INBOX_RE = re.compile(r"^[A-Za-z0-9_$-]+(\.[A-Za-z0-9_$-]+)*$")


class SettingsError(ValueError):
    """An environment variable with a value lorafleet cannot use.

    The one base of every settings error (the agent's AgentConfigError is
    one): a process stopped by one exits 2 with its one line (lorafleet._runtime).
    """


def default_data_dir() -> str:
    """The data directory when LORAFLEET_DATA_DIR is not set: $XDG_DATA_HOME/lorafleet,
    else ~/.local/share/lorafleet."""
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
    #: "_INBOX_<node>"; a service or client on its own nkey identity
    #: "_INBOX.service.<name>" or "_INBOX.client.<name>" (`lorafleet auth`
    #: writes each into the identity's env file).
    nats_inbox_prefix: str = "_INBOX"
    #: Prefix of every subject, stream and bucket. Default "lorafleet".
    subject_prefix: str = DEFAULT_PREFIX
    #: SQLAlchemy URL of the system of record (postgresql+psycopg://... or
    #: sqlite+aiosqlite:///...). Default: SQLite under `data_dir`.
    database_url: str = ""
    #: Where the embedded default keeps its NATS store and database.
    data_dir: str = field(default_factory=default_data_dir)
    #: Seconds between an agent's heartbeats; default 1.
    heartbeat_s: float = 1.0
    #: Seconds without a heartbeat after which a node is gone and its job
    #: fails; also the heartbeat's TTL in KV (whole seconds). Default 3.
    node_timeout_s: int = 3
    #: Seconds to wait for the first connection before failing; default 5.
    connect_timeout_s: float = 5.0
    #: Seconds a request waits for its reply; default 5.
    request_timeout_s: float = 5.0
    #: Seconds a request nobody answers ("no responders") is sent again, every
    #: 0.1 s, before NoRespondersError; default 5, 0 = once. A service
    #: restarting (bench/recorder_start.py), or its last replica, is then no error.
    no_responders_retry_s: float = 5.0
    #: JetStream replicas for streams, KV and object stores (3 on a cluster).
    replicas: int = 1
    #: "debug", "info", "warning" or "error".
    log_level: str = "info"
    #: Seconds the server waits for the recorder's ack of a status report
    #: before redelivering it; default 10: how long a report a killed recorder
    #: or a dying NATS server held waits to come back (a batch being applied
    #: is told "in progress": lorafleet.nats._consumer).
    recorder_ack_wait_s: float = 10.0
    #: Seconds the recorder waits at start for PostgreSQL to answer (down, or
    #: still starting: each try, a second apart, is logged), then exits
    #: saying so; default 60, 0 = one try.
    database_wait_s: float = 60.0
    #: Seconds a job may stay `uploading` after its agent delivered every
    #: artifact before the scheduler takes the delivery for lost (requeued to
    #: resume from its checkpoint, else failed).
    delivery_store_wait_s: float = 300.0
    #: Seconds after its newest chunk that an object chunk subject no object
    #: refers to is taken for a dead artifact-store's leftovers and purged
    #: (artifact_store/DESIGN.md); default 600.
    artifact_orphan_age_s: float = 600.0
    #: Retention (docs/operations.md, "Retention"). Seconds between the
    #: periodic sweeps of the artifact-store (artifacts) and the recorder
    #: (datasets); 0: no periodic sweep (`lorafleet gc` still runs one).
    retention_sweep_every_s: float = 3600.0
    #: Seconds an object must have been found unneeded, by sweeps that far
    #: apart, before it is removed: a reference may be on its way (a submit
    #: naming a file the sweep saw deleted).
    retention_grace_s: float = 600.0
    #: A final job's checkpoint is removed this long after the job ended (a
    #: checkpoint only serves a resume; it is the largest object a job
    #: leaves); 0: kept for ever. Default 14 days.
    retention_checkpoint_after_s: float = 1_209_600.0
    #: A done job's adapter (peft, gguf), not served, with no serving policy,
    #: is removed this long after the job ended; 0 (the default): kept for
    #: ever, since it is what the job was for.
    retention_adapter_after_s: float = 0.0
    #: The data of final jobs only (no gateway file names it) is removed this
    #: long after the newest of them ended; 0 (the default): kept while any
    #: job names it. Data no job and no file names goes after the grace.
    retention_dataset_after_s: float = 0.0
    #: Log lines as "json" or "console" (for a person); default: console on
    #: a terminal, JSON otherwise (see lorafleet.log).
    log_format: str = ""
    #: This process's NATS identity: a file holding its nkey seed (`SU...`,
    #: mode 0600; `lorafleet auth` writes one per node, service and client).
    #: Default none (no nkey; a user and password in the URL, or no auth).
    nats_nkey_seed: str | None = None
    #: TLS: a PEM file of the CA that signed the server's certificate (and
    #: switches TLS on). Default none: the system's CAs when a URL is tls://.
    nats_tls_ca: str | None = None
    #: TLS: this process's client certificate (PEM), for a server that
    #: verifies clients; with `nats_tls_key`. Default none.
    nats_tls_cert: str | None = None
    #: TLS: the private key (PEM) of `nats_tls_cert`. Default none.
    nats_tls_key: str | None = None
    #: Where this process serves Prometheus metrics (`GET /metrics`):
    #: "host:port", ":port" (every interface) or port 0 (a free one, logged
    #: on `service.started`). Default "": off, since two processes on one
    #: host would collide on any fixed default; `lorafleet up` turns it on.
    metrics_addr: str = ""
    #: Seconds a finished job's per-job series stay on the metrics endpoint,
    #: so that the last scrape sees its final values; default 60.
    metrics_linger_s: float = 60.0

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
        if self.no_responders_retry_s < 0:
            raise SettingsError("LORAFLEET_NO_RESPONDERS_RETRY_S must be >= 0 seconds")
        if self.replicas not in (1, 3, 5):
            raise SettingsError("LORAFLEET_REPLICAS must be 1, 3 or 5")
        if self.recorder_ack_wait_s <= 0:
            raise SettingsError("LORAFLEET_RECORDER_ACK_WAIT_S must be > 0 seconds")
        if self.database_wait_s < 0:
            raise SettingsError("LORAFLEET_DATABASE_WAIT_S must be >= 0 seconds")
        if self.artifact_orphan_age_s < 0:
            raise SettingsError("LORAFLEET_ARTIFACT_ORPHAN_AGE_S must be >= 0 seconds")
        for name in ("sweep_every", "grace", "checkpoint_after", "adapter_after", "dataset_after"):
            if getattr(self, f"retention_{name}_s") < 0:
                raise SettingsError(
                    f"LORAFLEET_RETENTION_{name.upper()}_S must be >= 0 seconds (0: off)"
                )
        if self.log_format not in ("", "json", "console"):
            raise SettingsError(
                f"LORAFLEET_LOG_FORMAT={self.log_format!r}: set it to json or console"
            )
        if (self.nats_tls_cert is None) != (self.nats_tls_key is None):
            raise SettingsError(
                "LORAFLEET_NATS_TLS_CERT and LORAFLEET_NATS_TLS_KEY go together: "
                "set both (a client certificate and its key) or neither"
            )
        if self.metrics_addr:
            parse_host_port(self.metrics_addr, "LORAFLEET_METRICS_ADDR")
        if self.metrics_linger_s < 0:
            raise SettingsError("LORAFLEET_METRICS_LINGER_S must be >= 0 seconds")

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


def parse_host_port(addr: str, setting: str) -> tuple[str, int]:
    """("host", port) of "host:port", ":port" (host "": every interface) or
    "[v6]:port"; a bad one raises SettingsError naming `setting`."""
    host, sep, port = addr.strip().rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise SettingsError(
            f"{setting}={addr!r} is not host:port: use e.g. 127.0.0.1:9460, :9460 "
            "(every interface) or 127.0.0.1:0 (a free port)"
        )
    return host, int(port)


#: Words an environment variable may use for a bool (any case).
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def read_env(
    cls: Any, prefix: str, env: Mapping[str, str], error: type[ValueError] = SettingsError
) -> dict[str, Any]:
    """The fields of `cls` (a dataclass or a msgspec Struct) found in `env`
    as `<prefix><FIELD>`, decoded by msgspec to each field's annotated type.

    What a value may look like: numbers as msgspec reads them from text;
    bools 1/true/yes/on or 0/false/no/off (any case); `X | None`: "" is
    None; tuples and lists comma separated; Path and other classes that take
    one string. A value that does not decode raises `error`, naming the
    variable, what it must be and its default.
    """
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in _fields(cls):
        key = f"{prefix}{f.name.upper()}"
        if key not in env:
            continue
        raw = env[key]
        try:
            values[f.name] = msgspec.convert(
                _prepare(raw, f.type), hints[f.name], strict=False, dec_hook=_from_text
            )
        except msgspec.ValidationError:
            raise error(_bad_value(key, raw, f)) from None
    return values


def write_env(obj: Any, prefix: str) -> dict[str, str]:
    """The inverse of `read_env`: each field not None as `<prefix><FIELD>`."""
    out: dict[str, str] = {}
    for f in _fields(type(obj)):
        value = getattr(obj, f.name)
        if value is None:
            continue
        out[f"{prefix}{f.name.upper()}"] = (
            ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)
        )
    return out


def _fields(cls: Any) -> tuple[mi.Field, ...]:
    info = mi.type_info(cls)
    if not isinstance(info, mi.DataclassType | mi.StructType):
        raise TypeError(f"{cls!r} is neither a dataclass nor a msgspec Struct")
    return info.fields


def _prepare(raw: str, typ: mi.Type) -> Any:
    """`raw` in the shape msgspec's lax conversion takes for `typ`."""
    kinds = typ.types if isinstance(typ, mi.UnionType) else (typ,)
    if any(isinstance(k, mi.NoneType) for k in kinds) and not raw.strip():
        return None
    if any(isinstance(k, mi.VarTupleType | mi.ListType | mi.TupleType) for k in kinds):
        return [part.strip() for part in raw.split(",") if part.strip()]
    if any(isinstance(k, mi.BoolType) for k in kinds):
        word = raw.strip().lower()
        if word in TRUE_WORDS:
            return True
        if word in FALSE_WORDS:
            return False
    return raw


def _from_text(typ: type, value: Any) -> Any:
    """Classes msgspec does not know (Path) are built from their text."""
    if isinstance(value, str):
        return typ(value)
    raise NotImplementedError


def _bad_value(key: str, raw: str, f: mi.Field) -> str:
    kinds = f.type.types if isinstance(f.type, mi.UnionType) else (f.type,)
    what = " or ".join(_WHAT.get(type(k), type(k).__name__.removesuffix("Type").lower())
                       for k in kinds if not isinstance(k, mi.NoneType))  # fmt: skip
    default = "" if f.default is msgspec.NODEFAULT else f" (default {f.default!r})"
    return f"{key}={raw!r} is not {what}: set {what}, or unset it{default}"


_WHAT: dict[type, str] = {
    mi.IntType: "a whole number",
    mi.FloatType: "a number",
    mi.BoolType: "a bool (1/true/yes/on or 0/false/no/off)",
    mi.StrType: "text",
}
