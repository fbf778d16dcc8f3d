"""Every place lorafleet works around nats-py (2.16), in one module.

Each function or class here says what upstream lacks or does wrong, and
tests/core/test_natspy.py pins that upstream behaviour: when a newer
nats-py fixes or changes it, its pin fails, telling us to drop (or redo)
the workaround. Nothing else in lorafleet reaches into nats-py privates,
so moving to a newer nats-py, or to nats.py's nats-core / nats-jetstream
packages, is this module's work.

Private plumbing: services import it, users of lorafleet do not.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import hashlib
import json
from typing import Any, BinaryIO

import msgspec
import nats.aio.client
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectStoreConfig, StreamInfo
from nats.js.kv import KeyValue
from nats.micro.service import Endpoint, Service

from lorafleet.names import (
    OBJECT_DIGEST_PREFIX,
    STATUS_NO_RESPONDERS,
    Header,
    kv_stream,
    kv_subject,
    object_chunk_subject,
    object_meta_subject,
    object_stream,
)
from lorafleet.nats._direct_get import SubjectReader

# --- the connection behind a JetStream context -----------------------------------


def client_of(js: JetStreamContext) -> Client:
    """The connection `js` was made from.

    Upstream: JetStreamContext keeps it as `_nc` with no public accessor,
    so code handed a context cannot publish plain messages on its connection
    or read its max payload.
    """
    conn: Client = js._nc
    return conn


# --- moving a connection to another server ------------------------------------------


#: Seconds one try of a move may take at least, however little time is left.
MOVE_TRY_MIN_S = 0.25
#: Seconds between two rounds of a move's tries when every server refused at once.
MOVE_ROUND_PAUSE_S = 0.1


async def move_to_another_server(nc: Client, within_s: float) -> bool:
    """Reconnect `nc` to a server of its pool at another address than the one
    it is on, trying each other address in turn; True once connected
    elsewhere within `within_s`.

    Upstream: `force_reconnect()` shuffles the pool and may well pick the
    server it left (one time in two with two servers), gives every try the
    connection's whole `connect_timeout` (5 s here: one frozen server would
    take all of a move's time), and returns before the reconnect (its task,
    `_reconnection_task`, ends once connected). The pool cannot simply lose
    the server left for the move: the INFO of the server moved to lists the
    cluster's members, which nats-py adds back under a new entry, so the
    server left can be in the pool twice, and a later move "moves" to its
    second entry (tests/core/test_natspy.py pins both). So the move steers
    nats-py's reconnect loop through its server-choice hook
    (`_reconnect_to_server_handler`, the `reconnect_to_server_handler`
    connect option, which lorafleet does not set otherwise): each other
    address in turn, never the one left, each try given an equal share of
    the time left (`options["connect_timeout"]`, read per try). After
    `within_s` the hook and the timeout are put back, and nats-py's own
    reconnect goes on over the whole pool (the server left may be the only
    one this node reaches).
    """
    current = nc._current_server
    if current is None or not nc.is_connected:
        return False
    left = current.uri.netloc
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    connect_timeout_s = nc.options["connect_timeout"]
    if not any(s.uri.netloc != left for s in nc._server_pool):
        return False
    nc._reconnect_to_server_handler = _others_in_turn(nc, left, end)
    try:
        await nc.force_reconnect()
        task = nc._reconnection_task
        if task is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(task), max(0.0, end - loop.time()))
    finally:
        nc._reconnect_to_server_handler = None
        nc.options["connect_timeout"] = connect_timeout_s
    on = nc._current_server
    return nc.is_connected and on is not None and on.uri.netloc != left


def _others_in_turn(nc: Client, left: str, end: float) -> nats.aio.client.ReconnectToServerHandler:
    """nats-py's server-choice hook for a move: each address but `left` in
    turn, each try given an equal share of the time left until `end`."""
    loop = asyncio.get_running_loop()
    tried: list[str] = []

    def next_server(
        servers: list[nats.aio.client.Server], _info: dict[str, Any]
    ) -> tuple[nats.aio.client.Server | None, float]:
        if tried and nc._transport is not None:
            # Upstream: a try that timed out leaves its socket open, and the
            # next try's connect replaces it without closing it. (nats-py
            # leaves Transport.close untyped.)
            transport: Any = nc._transport
            transport.close()
        others = {s.uri.netloc: s for s in servers if s.uri.netloc != left}
        untried = [addr for addr in others if addr not in tried]
        pause_s = 0.0
        if not untried:  # each refused at once: another round, not a busy loop
            tried.clear()
            untried, pause_s = list(others), MOVE_ROUND_PAUSE_S
        tried.append(untried[0])
        share_s = (end - loop.time() - pause_s) / len(untried)
        nc.options["connect_timeout"] = max(MOVE_TRY_MIN_S, share_s)
        return others[untried[0]], pause_s

    return next_server


# --- micro: counting the error replies a handler sends itself ---------------------


def last_endpoint(svc: Service) -> Endpoint:
    """The endpoint `svc.add_endpoint` added last.

    Upstream: add_endpoint returns None, and the service keeps its endpoints
    in the private `_endpoints`.
    """
    endpoints: list[Endpoint] = svc._endpoints
    return endpoints[-1]


def count_endpoint_error(endpoint: Endpoint, error: str) -> None:
    """Count an error reply in `nats micro stats` (num_errors, last_error).

    Upstream: micro counts only what a handler raises (and then answers with
    its own body); a handler that answers with `respond_error` itself, as
    lorafleet's do to send a JSON error body, is counted as a success.
    Stats read the private `_num_errors` and `_last_error`.
    """
    # nats-py types `_last_error` from its None default.
    counters: Any = endpoint
    counters._num_errors += 1
    counters._last_error = error


# --- the socket read size ------------------------------------------------------------


def use_read_buffer(size_bytes: int) -> None:
    """Read at least `size_bytes` per socket read, on every connection of this process.

    Upstream: connect has no option for it; the client reads
    `nats.aio.client.DEFAULT_BUFFER_SIZE` (32 KiB) bytes per read, a module
    global looked up at each read. A process that receives bulk (the
    artifact-store) wakes up far less often with a bigger one. Never lowers it.
    """
    nats.aio.client.DEFAULT_BUFFER_SIZE = max(nats.aio.client.DEFAULT_BUFFER_SIZE, size_bytes)


# --- asynchronous JetStream publish ----------------------------------------------------


class PublishRefusedError(Exception):
    """JetStream answered a publish with an error (a full stream, a wrong subject, ...)."""

    def __init__(self, description: str, code: int = 0, err_code: int = 0) -> None:
        super().__init__(description)
        self.description = description
        self.code = code
        self.err_code = err_code


class NoStreamError(PublishRefusedError):
    """No stream took the publish (no responders)."""


class _PubError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _PubReply(msgspec.Struct):
    error: _PubError | None = None
    seq: int = 0
    duplicate: bool = False


class AsyncPublisher:
    """JetStream publishes whose acknowledgements are collected on one inbox.

    `publish()` returns a future of the stored message's stream sequence,
    or of PublishRefusedError. Cancel a future to stop waiting for it.

    Upstream: `js.publish_async`'s reply callback turns a stream's refusal
    into an exception with `APIError.from_error`, which raises instead of
    returning; the exception escapes the callback (to the error callback)
    and the publish's future never ends.
    """

    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._prefix = ""
        self._sub: Subscription | None = None
        self._futures: dict[str, asyncio.Future[int]] = {}
        self._next = 0

    async def start(self) -> AsyncPublisher:
        self._prefix = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._prefix + ".*", cb=self._on_reply)
        return self

    async def stop(self) -> None:
        """Cancel every future still waiting and unsubscribe."""
        for fut in list(self._futures.values()):
            fut.cancel()
        self._futures.clear()
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def __aenter__(self) -> AsyncPublisher:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def publish(
        self, subject: str, body: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[int]:
        if self._sub is None:
            raise RuntimeError("AsyncPublisher.start() first")
        self._next += 1
        token = str(self._next)
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._futures[token] = fut
        fut.add_done_callback(lambda _: self._futures.pop(token, None))
        await self._nc.publish(subject, body, reply=f"{self._prefix}.{token}", headers=headers)
        return fut

    async def _on_reply(self, msg: Msg) -> None:
        fut = self._futures.pop(msg.subject[len(self._prefix) + 1 :], None)
        if fut is None or fut.done():
            return
        if msg.headers and msg.headers.get(Header.STATUS) == STATUS_NO_RESPONDERS:
            fut.set_exception(NoStreamError("no stream answered (no responders)", 503))
            return
        try:
            reply = msgspec.json.decode(msg.data, type=_PubReply)
        except msgspec.DecodeError:
            fut.set_exception(PublishRefusedError(f"not a JetStream reply: {msg.data[:200]!r}"))
            return
        if reply.error is not None:
            e = reply.error
            fut.set_exception(PublishRefusedError(e.description, e.code, e.err_code))
        else:
            fut.set_result(reply.seq)


# --- reading objects by message gets --------------------------------------------------


class ObjectNotFoundError(LookupError):
    """No such object (or it was deleted) in the bucket."""


class ObjectDamagedError(ValueError):
    """The object's chunks are not what its meta message says (size, digest)."""


class ObjectChunksMissingError(ObjectDamagedError):
    """The object store holds fewer chunks of an object than its info names."""

    def __init__(self, bucket: str, name: str, subject: str, held: int, chunks: int) -> None:
        self.subject, self.held, self.chunks = subject, held, chunks
        #: What is missing, without the object's name. Which chunk of several
        #: is not known: a subject's messages carry no index of their own.
        self.detail = (
            f"{chunks - held} of its {chunks} chunks missing from {subject} "
            f"(the store holds {held})"
        )
        super().__init__(f"object {name!r} in {bucket}: {self.detail}")


def _object_info(data: bytes) -> ObjectInfo | None:
    try:
        raw: Any = json.loads(data)
        return ObjectInfo.from_response(raw) if isinstance(raw, dict) else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


async def read_object(js: JetStreamContext, bucket: str, name: str, out: BinaryIO) -> int:
    """Write object `name` of `bucket` into `out`; return its size in bytes
    (`read_object_sha256` says how)."""
    size, _sha256 = await read_object_sha256(js, bucket, name, out)
    return size


async def read_object_sha256(
    js: JetStreamContext, bucket: str, name: str, out: BinaryIO
) -> tuple[int, str]:
    """Write object `name` of `bucket` into `out`; return its size in bytes
    and the hex sha256 of what was written (no second pass over it).

    Reads the object's meta message with `$JS.API.STREAM.MSG.GET` on
    `OBJ_<bucket>` (the leader's: never a stale info), then its chunks with
    batched direct gets (`$JS.API.DIRECT.GET`, `_direct_get.SubjectReader`, 16 chunks per
    request), so those two subjects on that one stream are all a reader's
    permissions need (names.object_read_subjects). Where a direct get
    fails (a stream without allow_direct, a replica behind the leader, a
    refused subject) the rest comes by message gets, one request per chunk
    (measured: about a fifth of the throughput). Checks the size and the
    sha256 the meta message records. Raises ObjectNotFoundError,
    ObjectDamagedError, or nats' errors (a timeout when the server does not
    answer, or refuses the request).

    Upstream: `ObjectStore.get` looks the stream up by subject
    (`$JS.API.STREAM.NAMES`, which lists every stream's name), asks for its
    info and creates a consumer; a node's credentials would have to allow all
    three. nats-py has no batched direct get.
    """
    stream = object_stream(bucket)
    try:
        meta = await js.get_last_msg(stream, object_meta_subject(bucket, name))
    except nats.js.errors.NotFoundError:
        raise ObjectNotFoundError(f"no object {name!r} in bucket {bucket}") from None
    info = _object_info(meta.data or b"")
    if info is None or info.deleted or not info.nuid:
        raise ObjectNotFoundError(f"no object {name!r} in bucket {bucket} (deleted)")
    h = hashlib.sha256()
    size = 0
    chunks = SubjectReader(js, client_of(js), stream, object_chunk_subject(bucket, info.nuid))
    async with chunks:
        while chunks.read < (info.chunks or 0):
            batch = await chunks.next_batch((info.chunks or 0) - chunks.read)
            if not batch:
                break
            await asyncio.to_thread(out.writelines, batch)
            for data in batch:
                h.update(data)
                size += len(data)
    if size != (info.size or 0):
        raise ObjectDamagedError(
            f"object {name!r} in {bucket}: read {size} bytes, its meta says {info.size or 0}"
        )
    if not digest_matches(info, h.digest()):
        raise ObjectDamagedError(f"object {name!r} in {bucket}: sha256 differs from its meta")
    return size, h.hexdigest()


def object_digest(sha256_hex: str) -> str:
    """The object store's digest field for a sha256 (`SHA-256=<base64url>`);
    `digest_matches` reads it back."""
    return OBJECT_DIGEST_PREFIX + base64.urlsafe_b64encode(bytes.fromhex(sha256_hex)).decode()


def digest_matches(info: ObjectInfo, sha256: bytes) -> bool:
    """Whether `sha256` is the digest the info records (true when it records none)."""
    want = (
        (info.digest or "")
        .removeprefix(OBJECT_DIGEST_PREFIX)
        .removeprefix(OBJECT_DIGEST_PREFIX.lower())
    )
    return not want or base64.urlsafe_b64decode(want) == sha256


# --- downloading objects into a file ----------------------------------------------------

#: Seconds a download waits for an object's next chunk, the store holding it,
#: before it calls the chunk missing (they come back to back).
CHUNK_WAIT_S = 10.0


async def download_object(
    js: JetStreamContext,
    bucket: str,
    name: str,
    out: BinaryIO,
    chunk_wait_s: float = CHUNK_WAIT_S,
) -> str:
    """Write object `name` of `bucket` into `out` (a file or io.BytesIO);
    answer the hex sha256 of what was written (a caller checking it needs
    no second pass over the file).

    Raises nats.js.errors.ObjectNotFoundError (ObjectDeletedError for a
    deleted one), ObjectChunksMissingError when the store holds fewer chunks
    than the info names (counted before reading; a chunk that does not come
    within `chunk_wait_s` seconds while reading), ObjectDamagedError when the
    sha256 differs from the info's.

    Upstream: `ObjectStore.get` reads the chunks through an ordered consumer
    with no bound, so an info whose chunks are gone waits for ever; and
    without `writeinto` it appends each chunk to an immutable bytes value,
    copying everything read so far for each chunk: quadratic in the
    object's size.
    """
    obs = await js.object_store(bucket)
    info = await obs.get_info(name)
    h = hashlib.sha256()
    if not info.size:
        return h.hexdigest()
    subject = object_chunk_subject(bucket, info.nuid or "")
    chunks = info.chunks or 0
    state = (await js.stream_info(object_stream(bucket), subjects_filter=subject)).state
    held = int((state.subjects or {}).get(subject, 0))
    if held < chunks:
        raise ObjectChunksMissingError(bucket, name, subject, held, chunks)
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        for got in range(chunks):
            try:
                msg = await sub.next_msg(timeout=chunk_wait_s)
            except nats.errors.TimeoutError:
                raise ObjectChunksMissingError(bucket, name, subject, got, chunks) from None
            await asyncio.to_thread(out.write, msg.data)
            h.update(msg.data)
    finally:
        await sub.unsubscribe()
    if not digest_matches(info, h.digest()):
        raise ObjectDamagedError(f"object {name!r} in {bucket}: sha256 differs from its info")
    return h.hexdigest()


# --- creating an object store from its config ------------------------------------------


async def create_object_store(js: JetStreamContext, config: ObjectStoreConfig) -> None:
    """Create (or keep) the object store `config` describes, bucket included.

    Upstream: `create_object_store` overwrites `config.bucket` with its own
    `bucket` argument (None when not given), so a complete config alone fails.
    """
    await js.create_object_store(config.bucket or "", config=config)


# --- permission refusals ---------------------------------------------------------------


def permissions_violation_message(e: BaseException) -> str | None:
    """The server's words when `e` is a permissions violation, else None.

    Upstream: nats-py does not raise for a refused publish or subscription:
    the server's `-ERR 'Permissions Violation for Publish to "..."'` reaches
    the error callback only, as an error whose text is the server's (a
    refused request then times out).
    """
    text = str(e)
    return text.removeprefix("nats: ") if "permissions violation" in text.lower() else None


def is_authorization_violation(e: BaseException) -> bool:
    """True when `e` is the server refusing this user and password.

    Upstream: while nats-py retries a first connect, the server's
    `-ERR 'Authorization Violation'` reaches the error callback only, and
    nats-py raises a plain error with the server's text, no class of its own.
    """
    return "authorization violation" in str(e).lower()


# --- the consumer behind a KV watch ------------------------------------------------------


async def watch_consumer_info(watcher: Any, timeout_s: float) -> Any:
    """The info of the consumer a `KeyValue.watch()` reads from (raises when
    it is gone: nats.js.errors.NotFoundError, or a timeout when its server is).

    Upstream: the KeyWatcher keeps its push subscription as the private
    `_sub`, and that subscription's `consumer_info()` takes no timeout (it
    waits the JetStream context's 5 s, too long for a health probe).
    """
    sub = watcher._sub
    if sub is None:
        raise LookupError("the watch has no subscription yet")
    return await asyncio.wait_for(sub.consumer_info(), timeout_s)


# --- a KV bucket's current values ---------------------------------------------------


#: Keys one listing reads at once (each the stream leader's message get).
KV_LIST_CONCURRENCY = 32


async def kv_values(
    js: JetStreamContext, kv: KeyValue, bucket: str, keys: str, timeout_s: float
) -> list[Any]:
    """The current entries of `kv` (the open bucket named `bucket`) whose keys
    match `keys` (a filter such as `jobs.bob.*`), deleted keys left out;
    raises TimeoutError when they are not all read within `timeout_s`.

    No consumer: the stream's per-subject counts name the keys, and each
    key's last message is read by the leader's message get, as `kv.get`
    reads it: twice a watch's time at 100 keys (7 ms against 3.4), the
    price of no consumer. A batched direct get would be one request, but a
    replica's direct get can be behind the leader and a gateway lists what
    it has just written, so its buckets have no allow_direct. Upstream's
    `KeyValue.watch()` makes an ephemeral ordered consumer per listing, and
    one whose interest a fault left stale is not reaped: nemesis seed 47's
    gateways piled them up on their KV stream until nats-server refused
    more ("maximum consumers limit reached"), 281 file listings refused
    over half an hour. (Its marker of "the current values are in" also
    raced its own consumer info and could read a listing as empty.)
    """

    async def read() -> list[Any]:
        subjects = await subject_counts(js, kv_stream(bucket), kv_subject(bucket, keys))
        prefix = kv_subject(bucket, "")
        gate = asyncio.Semaphore(KV_LIST_CONCURRENCY)

        async def last(key: str) -> Any:
            async with gate:
                try:
                    return await kv.get(key)
                except (nats.js.errors.KeyDeletedError, nats.js.errors.KeyNotFoundError):
                    return None  # deleted, or purged since the counts were read

        names = [subject.removeprefix(prefix) for subject in subjects]
        entries = await asyncio.gather(*(last(key) for key in names))
        return [e for e in entries if e is not None and e.value]

    try:
        return await asyncio.wait_for(read(), timeout_s)
    except TimeoutError:
        raise TimeoutError(f"the values of {keys} in {bucket} took over {timeout_s:g} s") from None


async def subjects_at(
    js: JetStreamContext, stream: str, subjects_filter: str
) -> tuple[dict[str, int], dt.datetime | None]:
    """Every subject of `stream` that matches `subjects_filter`, with its
    message count, and the time the server answered, on its clock (`ts`;
    None from a server before 2.10).

    Upstream: nats-server answers at most 100,000 subjects a request
    (JSMaxSubjectDetails) with their `total`, and nats-py's `stream_info`
    reads only that first page, so a bucket with more keys lists short,
    silently; here the rest are read a page at a time (`offset`). The server
    sorts the subjects anew for each page, so a subject that comes or goes
    between two pages can shift another across the boundary: a listing of
    several pages is not one instant's. nats-py's StreamInfo also drops `ts`:
    the age of a stored message taken against it is on one clock, the
    server's, which a step or a skew of the asking host's clock does not move."""
    subjects: dict[str, int] = {}
    server_now: dt.datetime | None = None
    info_subject = f"{js._prefix}.STREAM.INFO.{stream}"
    offset = 0
    while True:
        body = json.dumps({"subjects_filter": subjects_filter, "offset": offset}).encode()
        resp = await js._api_request(info_subject, body, timeout=js._timeout)
        if offset == 0:
            StreamInfo._convert_utc_iso(resp, "ts")
            server_now = resp.get("ts")
        page: dict[str, int] = (resp.get("state") or {}).get("subjects") or {}
        subjects.update(page)
        offset += len(page)
        if not page or offset >= int(resp.get("total") or 0):
            return subjects, server_now


async def subject_counts(js: JetStreamContext, stream: str, subjects_filter: str) -> dict[str, int]:
    """`subjects_at` without the server's time: every matching subject, paged."""
    subjects, _ = await subjects_at(js, stream, subjects_filter)
    return subjects
