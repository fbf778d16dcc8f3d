"""NATS for lorafleet: connecting, the JetStream layout, requests and replies.

What costs what: `connect` fails within `connect_timeout_s` when no server
answers (nats-py alone would retry the first connect for minutes), and
reconnects forever after a first success. `ensure_layout` is idempotent and
cheap enough to call at every service start.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
import stamina
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

import lorafleet.log as log
from lorafleet._tasks import within
from lorafleet.errors import ConnectError, raise_for_error
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet.nats._natspy import (
    create_object_store,
    is_authorization_violation,
    permissions_violation_message,
)
from lorafleet.settings import Settings

T = TypeVar("T")

#: Status reports are kept this long after the recorder has applied them,
#: so a rebuilt recorder can replay a week; seconds.
STATUS_MAX_AGE_S = 7 * 24 * 3600
#: De-duplication window of the status stream (Nats-Msg-Id); seconds.
STATUS_DUPLICATE_WINDOW_S = 120
#: De-duplication window of the artifact chunk stream (Nats-Msg-Id); seconds.
ARTIFACT_DUPLICATE_WINDOW_S = 10 * 60
#: The leader key expires this long after the leader's last renewal; seconds.
LEADER_TTL_S = 3


#: Seconds between two reconnect attempts after a connection is lost.
RECONNECT_WAIT_S = 0.25
#: Seconds between pings to the server.
PING_INTERVAL_S = 5
#: Pings unanswered before the connection counts as lost.
MAX_OUTSTANDING_PINGS = 2
#: Seconds a closing connection may drain before it is closed.
CONNECTION_DRAIN_TIMEOUT_S = 5.0
#: Seconds between two tries of a request nobody answered.
NO_RESPONDERS_PAUSE_S = 0.1
#: Seconds before a read JetStream answered "temporarily unavailable" is made again.
UNAVAILABLE_PAUSE_S = 1.0


def redact_url(url: str) -> str:
    """`url` without the password of any `user:password@` in it (for messages)."""
    return re.sub(r"//([^:@/,]*):[^/,]*@", r"//\1:***@", url)


def _unauthorized(settings: Settings) -> ConnectError:
    if settings.nats_nkey_seed:
        return ConnectError(
            f"the NATS server at {redact_url(settings.nats_url)} refused the nkey in "
            f"{settings.nats_nkey_seed} (Authorization Violation): its public key is not in "
            "the server's config; re-run `lorafleet auth` with this identity and reload "
            "the server, or point LORAFLEET_NATS_NKEY_SEED at this process's own seed"
        )
    return ConnectError(
        f"the NATS server at {redact_url(settings.nats_url)} refused this user and "
        "password (Authorization Violation): set LORAFLEET_NATS_URL to "
        "nats://USER:PASSWORD@HOST:PORT with a user of its config (`lorafleet nats-config`), "
        "or LORAFLEET_NATS_NKEY_SEED to this process's seed (`lorafleet auth`)"
    )


def _tls_failed(settings: Settings, error: BaseException) -> ConnectError:
    reason = getattr(error, "reason", None) or getattr(error, "verify_message", None) or error
    return ConnectError(
        f"the TLS handshake with {redact_url(settings.nats_url)} failed ({reason}): set "
        "LORAFLEET_NATS_TLS_CA to the CA that signed the server's certificate, connect by "
        "a host name the certificate names, and set LORAFLEET_NATS_TLS_CERT and "
        "LORAFLEET_NATS_TLS_KEY when the server verifies clients"
    )


def _unreachable(settings: Settings) -> ConnectError:
    return ConnectError(
        f"no NATS server answered at {redact_url(settings.nats_url)} within "
        f"{settings.connect_timeout_s:g} s; start one (`lorafleet up` runs an embedded one) "
        "or set LORAFLEET_NATS_URL"
    )


class _Callbacks:
    """nats-py's callbacks of one connection: they log what happens to it."""

    def __init__(self, on_refused: Callable[[str], bool | None] | None) -> None:
        self.logger = log.get()
        self.on_refused = on_refused
        # A wrong user or password reaches only the error callback while
        # nats-py retries the first connect: remembered, to say so when it gives up.
        self.unauthorized = False
        # Likewise a failed TLS handshake (an unknown CA, a wrong host name,
        # a server that wants a client certificate): kept to name it.
        self.tls_error: ssl.SSLError | None = None
        self.conn: Client | None = None

    async def error(self, e: Exception) -> None:
        if is_authorization_violation(e):
            self.unauthorized = True
        if isinstance(e, ssl.SSLError):
            self.tls_error = e
        refused = permissions_violation_message(e)
        if refused is None:
            self.logger.warning(Event.NATS_ERROR, error=repr(e))
            return
        # A refusal its caller expected is logged by the caller, once.
        if self.on_refused is not None and self.on_refused(refused):
            return
        self.logger.warning(
            Event.NATS_REFUSED, message=refused, error=permissions_violation_hint(refused)
        )

    async def disconnected(self) -> None:
        # nats-py calls disconnected_cb on a deliberate close too: only a lost
        # connection is worth a warning.
        if self.conn is not None and (self.conn.is_closed or self.conn.is_draining):
            return
        self.logger.warning(Event.NATS_DISCONNECTED)

    async def reconnected(self) -> None:
        self.logger.info(Event.NATS_RECONNECTED)


def permissions_violation_hint(refused: str) -> str:
    """What to check after the server's refusal `refused` (its own words)."""
    if "subscription" in refused.lower() and '"_inbox' in refused.lower():
        return (
            "the server refused this process's reply inbox: an identity reads replies on "
            "its own prefix only; set LORAFLEET_NATS_INBOX_PREFIX as its env file says "
            "(`lorafleet auth` writes it)"
        )
    return (
        "the server refused this for want of permission: check that this process runs "
        "with its own identity (LORAFLEET_NATS_NKEY_SEED) and that the server's config "
        "is current (`lorafleet auth`, then reload the server)"
    )


def _options(settings: Settings, name: str, callbacks: _Callbacks) -> dict[str, Any]:
    options: dict[str, Any] = {
        "servers": [u.strip() for u in settings.nats_url.split(",") if u.strip()],
        "name": name,
        "connect_timeout": max(1, int(settings.connect_timeout_s)),
        "reconnect_time_wait": RECONNECT_WAIT_S,
        "max_reconnect_attempts": -1,
        "allow_reconnect": True,
        "ping_interval": PING_INTERVAL_S,
        "max_outstanding_pings": MAX_OUTSTANDING_PINGS,
        "error_cb": callbacks.error,
        "disconnected_cb": callbacks.disconnected,
        "reconnected_cb": callbacks.reconnected,
        "inbox_prefix": settings.nats_inbox_prefix,
    }
    if settings.nats_creds:
        options["user_credentials"] = settings.nats_creds
    options.update(identity_options(settings))
    return options


def identity_options(settings: Settings) -> dict[str, Any]:
    """nats.connect's options for this process's nkey seed and TLS files.

    Each file is checked here, so a missing or unreadable one is a
    ConnectError naming its setting rather than a failure deep in nats-py.
    """
    options: dict[str, Any] = {}
    if settings.nats_nkey_seed:
        _readable(settings.nats_nkey_seed, "LORAFLEET_NATS_NKEY_SEED", "an nkey seed file")
        options["nkeys_seed"] = settings.nats_nkey_seed
    if settings.nats_tls_ca or settings.nats_tls_cert:
        options["tls"] = tls_context(settings)
    return options


def tls_context(settings: Settings) -> ssl.SSLContext:
    """A client TLS context: the server checked against `nats_tls_ca` (else
    the system's CAs), and this process's certificate when one is set."""
    ca = settings.nats_tls_ca
    if ca:
        _readable(ca, "LORAFLEET_NATS_TLS_CA", "a PEM CA certificate")
    try:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca or None)
    except ssl.SSLError as e:
        raise ConnectError(f"LORAFLEET_NATS_TLS_CA={ca}: not a PEM CA certificate ({e})") from None
    if settings.nats_tls_cert and settings.nats_tls_key:
        cert, key = settings.nats_tls_cert, settings.nats_tls_key
        _readable(cert, "LORAFLEET_NATS_TLS_CERT", "a PEM certificate")
        _readable(key, "LORAFLEET_NATS_TLS_KEY", "a PEM private key")
        try:
            ctx.load_cert_chain(cert, key)
        except ssl.SSLError as e:
            raise ConnectError(
                f"LORAFLEET_NATS_TLS_CERT={cert} and LORAFLEET_NATS_TLS_KEY={key} "
                f"are not a certificate and its key ({e})"
            ) from None
    return ctx


def _readable(path: str, setting: str, what: str) -> None:
    try:
        with open(path, "rb"):
            pass
    except OSError as e:
        raise ConnectError(
            f"{setting}={path}: cannot read {what} there ({e.strerror}); "
            "point it at the file `lorafleet auth` wrote, or unset it"
        ) from None


async def connect(
    settings: Settings,
    name: str,
    *,
    on_refused: Callable[[str], bool | None] | None = None,
    **kwargs: Any,
) -> Client:
    """Connect with reconnect-forever, after failing fast on the first attempt.

    Replies come on `settings.nats_inbox_prefix` inboxes. A refusal for
    want of permission is passed to `on_refused` (the server's words) and,
    unless it returns True (the caller expected it and logs it itself),
    logged as a `nats.refused` warning with those words and a hint; other
    asynchronous errors as `nats.error`.
    `kwargs` go to nats.connect over lorafleet's options.
    """
    callbacks = _Callbacks(on_refused)
    options = _options(settings, name, callbacks) | kwargs
    try:
        nc = await within(settings.connect_timeout_s, nats.connect(**options))
    except (TimeoutError, OSError, nats.errors.NoServersError) as e:
        if callbacks.unauthorized:
            raise _unauthorized(settings) from None
        if callbacks.tls_error is not None or isinstance(e, ssl.SSLError):
            raise _tls_failed(settings, callbacks.tls_error or e) from None
        raise _unreachable(settings) from e
    except nats.errors.Error as e:
        if not is_authorization_violation(e):
            raise
        raise _unauthorized(settings) from None
    callbacks.conn = nc
    return nc


@dataclass(frozen=True, slots=True)
class Layout:
    """The JetStream pieces a lorafleet installation uses."""

    names: Names
    replicas: int = 1
    node_ttl_s: int = 3

    def status_stream(self) -> StreamConfig:
        return StreamConfig(
            name=self.names.status_stream,
            subjects=[self.names.status_subjects],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=STATUS_MAX_AGE_S,
            num_replicas=self.replicas,
            duplicate_window=STATUS_DUPLICATE_WINDOW_S,
            discard=DiscardPolicy.OLD,
        )

    def artifacts_stream(self) -> StreamConfig:
        # Chunks stay until the artifact-store has committed the whole
        # artifact and purges its subject; DiscardPolicy.NEW so a full
        # stream refuses new deliveries rather than dropping half of one.
        return StreamConfig(
            name=self.names.artifacts_stream,
            subjects=[self.names.artifacts_subjects],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            num_replicas=self.replicas,
            duplicate_window=ARTIFACT_DUPLICATE_WINDOW_S,
            discard=DiscardPolicy.NEW,
        )

    def nodes_kv(self) -> KeyValueConfig:
        # One value per key; each heartbeat carries a per-message TTL and
        # the server leaves a MaxAge marker when the last one expires.
        return KeyValueConfig(
            bucket=self.names.nodes_bucket,
            history=1,
            storage=StorageType.FILE,
            replicas=self.replicas,
            limit_marker_ttl=max(1, self.node_ttl_s),
            description="lorafleet node heartbeats",
        )

    def leader_kv(self) -> KeyValueConfig:
        return KeyValueConfig(
            bucket=self.names.leader_bucket,
            history=1,
            storage=StorageType.FILE,
            replicas=self.replicas,
            limit_marker_ttl=LEADER_TTL_S,
            description="lorafleet scheduler leadership",
        )

    def node_marks_kv(self) -> KeyValueConfig:
        # Values live until deleted: a cordon outlasts every restart.
        return KeyValueConfig(
            bucket=self.names.node_marks_bucket,
            history=1,
            storage=StorageType.FILE,
            replicas=self.replicas,
            description="lorafleet cordoned and drained nodes",
        )

    def gateway_kv(self) -> KeyValueConfig:
        # Values live until deleted: a file object or a job's OpenAI fields
        # must survive a gateway restart (lorafleet_services.gateway.state).
        return KeyValueConfig(
            bucket=self.names.gateway_bucket,
            history=1,
            storage=StorageType.FILE,
            replicas=self.replicas,
            description="lorafleet gateway: file objects, jobs' OpenAI fields",
        )

    def datasets_store(self) -> ObjectStoreConfig:
        return ObjectStoreConfig(
            bucket=self.names.datasets_bucket,
            storage=StorageType.FILE,
            replicas=self.replicas,
            description="lorafleet training data (NDJSON)",
        )

    def artifacts_store(self) -> ObjectStoreConfig:
        return ObjectStoreConfig(
            bucket=self.names.artifacts_bucket,
            storage=StorageType.FILE,
            replicas=self.replicas,
            description="lorafleet artifacts: <job>/<kind>",
        )


#: JetStream's "no suitable peers for placement": a cluster just ready with a
#: member not yet connected, or one down; the layout is tried again
#: (`when_cluster_answers`), never taken for a stream that exists.
NO_PLACEMENT_ERR_CODE = 10005


def placement_pending(e: Exception) -> bool:
    """Whether `e` is JetStream's "no suitable peers for placement"."""
    return isinstance(e, nats.js.errors.BadRequestError) and e.err_code == NO_PLACEMENT_ERR_CODE


#: Errors of a JetStream request that a cluster between leaders explains: a
#: member electing a stream's or the meta leader times out (or answers "no
#: responders"), one still catching up answers 503 "temporarily unavailable".
CLUSTER_PENDING = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)
#: Seconds a service's start waits for its cluster to answer: a minority
#: member answers no JetStream request until it is back, an election takes
#: seconds on a loaded host (tests/nemesis/test_found.py pins it).
CLUSTER_WAIT_S = 30.0
#: Seconds between those tries.
CLUSTER_WAIT_PAUSE_S = 1.0


class ClusterUnavailableError(ConnectError):
    """The NATS cluster did not answer a start's JetStream request in time."""


def cluster_pending(e: BaseException) -> bool:
    """Whether `e` is a JetStream answer that a cluster between leaders (or
    placing a new stream's group) explains: worth trying again."""
    return isinstance(e, CLUSTER_PENDING) or (isinstance(e, Exception) and placement_pending(e))


async def when_cluster_answers(
    what: str,
    work: Callable[[], Awaitable[T]],
    wait_s: float = CLUSTER_WAIT_S,
    pause_s: float = CLUSTER_WAIT_PAUSE_S,
) -> T:
    """`work()`, tried again every `pause_s` while the cluster answers as one
    between leaders does (`cluster_pending`; each try logged as
    `nats.waiting`), for `wait_s` seconds; then ClusterUnavailableError naming
    `what` (as "the artifact-store's recovery") and the last answer. Every
    JetStream step of a service's start goes through here, so a start that
    meets an election waits for it instead of exiting. Other errors pass."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    tries = 0
    while True:
        tries += 1
        try:
            return await work()
        except Exception as e:
            if not cluster_pending(e):
                raise
            waited_s = loop.time() - started
            if waited_s + pause_s > wait_s:
                raise ClusterUnavailableError(
                    f"{what}: the NATS cluster did not answer within {wait_s:g} s ({tries} "
                    f"tries; the last: {e!r}): a majority of its servers must be up and "
                    "routed to each other (their logs say which is not), then start it again"
                ) from e
            log.get().warning(
                Event.NATS_WAITING, what=what, tries=tries, waited_s=round(waited_s, 1),
                wait_s=wait_s, error=repr(e),
            )  # fmt: skip
            await asyncio.sleep(pause_s)


async def ensure_layout(
    js: JetStreamContext, layout: Layout, parts: tuple[str, ...] | None = None
) -> None:
    """Create (or update to these settings) every stream, KV and object store,
    or only `parts` (Layout's method names: "status_stream", "nodes_kv", ...;
    a service with its own identity creates only what it owns,
    lorafleet.access.permissions.owned_layout_parts)."""

    def wanted(part: str) -> bool:
        return parts is None or part in parts

    for part in ("status_stream", "artifacts_stream"):
        if wanted(part):
            cfg: StreamConfig = getattr(layout, part)()
            try:
                await js.add_stream(cfg)
            except nats.js.errors.BadRequestError as e:
                if e.err_code == NO_PLACEMENT_ERR_CODE:
                    raise  # not a stream that exists: a member not there yet
                await js.update_stream(cfg)
    for part in ("nodes_kv", "leader_kv", "node_marks_kv", "gateway_kv"):
        if wanted(part):
            await js.create_key_value(getattr(layout, part)())
    for part in ("datasets_store", "artifacts_store"):
        if wanted(part):
            await create_object_store(js, getattr(layout, part)())


def layout_for(settings: Settings) -> Layout:
    return Layout(settings.names, settings.replicas, settings.node_timeout_s)


# --- encoding ---------------------------------------------------------------

_encoder = msgspec.json.Encoder()


def encode(message: Any) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes, typ: type[T]) -> T:
    return msgspec.json.decode(data, type=typ)


async def request(
    nc: Client,
    subject: str,
    message: Any,
    reply_type: type[T],
    timeout_s: float = 5.0,
    no_responders_retry_s: float = 2.0,
    *,
    idempotent: bool = False,
) -> T:
    """Send `message` and decode the reply as `reply_type`; an error reply
    raises its lorafleet.errors.ApiError.

    A responder that has just reconnected or restarted can be missed for a
    moment (no responders); the request is retried for `no_responders_retry_s`.
    An `idempotent` request (one whose repeat changes nothing: a read) that
    got no reply within `timeout_s` is sent once more: a responder killed
    while it held the request never answers, and another one will.
    """

    def once() -> Awaitable[T]:
        return _request_once(nc, subject, message, reply_type, timeout_s, no_responders_retry_s)

    return await (once_more_on_timeout(once) if idempotent else once())


async def once_more_on_timeout(read: Callable[[], Awaitable[T]]) -> T:
    """`read()`, made once more when it timed out. For a read (its repeat
    changes nothing): a request whose reply was lost never gets one — the
    responder killed while it held it, or the connection's own server gone
    with the reply (nats-py sends a request made while reconnecting once
    reconnected, but not again one already sent) — and the second goes out
    on the link as it is now. One JetStream answered "temporarily unavailable"
    is asked again after UNAVAILABLE_PAUSE_S."""
    try:
        return await read()
    except TimeoutError:
        pass
    except nats.js.errors.ServiceUnavailableError:
        # JetStream's own 503 (a member restarting, a leader being elected):
        # asked again a moment later, as a client would.
        await asyncio.sleep(UNAVAILABLE_PAUSE_S)
    return await read()


async def _request_once(
    nc: Client,
    subject: str,
    message: Any,
    reply_type: type[T],
    timeout_s: float,
    no_responders_retry_s: float,
) -> T:
    payload = message if isinstance(message, bytes) else encode(message)
    retries = stamina.retry_context(
        on=nats.errors.NoRespondersError,
        attempts=None if no_responders_retry_s > 0 else 1,
        timeout=no_responders_retry_s if no_responders_retry_s > 0 else None,
        wait_initial=NO_RESPONDERS_PAUSE_S,
        wait_max=NO_RESPONDERS_PAUSE_S,
        wait_jitter=0,
    )
    async for attempt in retries:
        with attempt:
            msg = await nc.request(subject, payload, timeout=timeout_s)
    raise_for_error(msg.data, msg.headers)
    return decode(msg.data, reply_type)


async def drain_quietly(nc: Client | None) -> None:
    if nc is None or nc.is_closed:
        return
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.drain(), CONNECTION_DRAIN_TIMEOUT_S)
    with contextlib.suppress(Exception):
        await nc.close()


Handler = Callable[[bytes], Awaitable[bytes]]
