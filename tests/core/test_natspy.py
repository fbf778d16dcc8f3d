"""Pins of the nats-py behaviour lorafleet.nats._natspy works around, and its workarounds.

Each `test_upstream_*` asserts what nats-py (2.16) does today. When one
fails after an upgrade, upstream has fixed or changed that behaviour: drop
or redo the workaround its docstring names, then this pin.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import datetime as dt
import hashlib
import inspect
import io
import itertools
import os
import signal
from pathlib import Path
from urllib.parse import urlparse

import nats
import nats.aio.client
import nats.js.errors
import nats.js.kv
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DiscardPolicy, ObjectStoreConfig, StreamConfig, StreamInfo
from nats.js.object_store import ObjectStore
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import EndpointConfig, ServiceConfig

from lorafleet import names
from lorafleet.access import passwords
from lorafleet.names import Names, msg_get_subject, object_read_subjects
from lorafleet.nats import _direct_get, _natspy
from lorafleet.nats.cluster import NatsCluster
from lorafleet.nats.server import NatsServer
from tests.eventually import eventually

#: Seconds a pin waits to be sure something upstream does not happen.
NEVER_S = 0.5
#: Seconds a move is given past frozen servers: a third each, the live one last.
MOVE_WITHIN_S = 3.0
#: A chunk size that splits the test object into several chunks; bytes.
SMALL_CHUNK_BYTES = 1024


async def _errors_collected(url: str, **kwargs: object) -> tuple[Client, list[Exception]]:
    errors: list[Exception] = []

    async def error_cb(e: Exception) -> None:
        errors.append(e)

    nc = await nats.connect(url, error_cb=error_cb, allow_reconnect=False, **kwargs)
    return nc, errors


# --- moving to another server ----------------------------------------------------


def _on(nc: Client) -> str:
    return nc.connected_url.netloc if nc.connected_url else ""


async def test_upstream_force_reconnect_may_come_back_to_the_same_server(
    tmp_path: Path,
) -> None:
    async with NatsServer(tmp_path / "a") as a, NatsServer(tmp_path / "b") as b:
        nc = await nats.connect([a.url, b.url], reconnect_time_wait=0)
        try:
            same = 0
            for _ in range(20):  # each stays with 1 in 2: all 20 moving is 1 in a million
                before = _on(nc)
                await nc.force_reconnect()
                await eventually(lambda: nc.is_connected, "reconnected")
                same += _on(nc) == before
            assert same > 0
        finally:
            await nc.close()


async def test_move_to_another_server_always_moves(tmp_path: Path) -> None:
    async with NatsServer(tmp_path / "a") as a, NatsServer(tmp_path / "b") as b:
        nc = await nats.connect([a.url, b.url], reconnect_time_wait=0)
        try:
            for _ in range(10):
                before = _on(nc)
                assert await _natspy.move_to_another_server(nc, within_s=5.0)
                assert nc.is_connected and _on(nc) != before
            assert len(nc.servers) == 2  # the pool as it was
            assert nc._reconnect_to_server_handler is None  # the hook put back
        finally:
            await nc.close()
        single = await nats.connect(a.url)
        try:
            assert not await _natspy.move_to_another_server(single, within_s=1.0)
        finally:
            await single.close()


def _addresses(nc: Client) -> list[str]:
    return sorted(s.uri.netloc for s in nc._server_pool)


async def test_upstream_info_puts_back_a_server_taken_out_of_the_pool(tmp_path: Path) -> None:
    """Why the move no longer takes the server it leaves out of the pool: the
    next server's INFO lists the cluster's members and nats-py adds the one
    taken out back under a new entry; put back afterwards, it was there twice."""
    async with NatsCluster(tmp_path / "c") as cluster:
        nc = await nats.connect(cluster.urls()[0], reconnect_time_wait=0)
        try:
            await eventually(lambda: len(nc._server_pool) == 3, "the members discovered")
            current = nc._current_server
            assert current is not None
            nc._server_pool.remove(current)
            await nc.force_reconnect()
            await eventually(lambda: nc.is_connected, "reconnected")
            assert current.uri.netloc in _addresses(nc)
            assert current not in nc._server_pool  # a new entry for the same address
        finally:
            await nc.close()


async def test_move_never_lands_on_the_server_it_leaves(tmp_path: Path) -> None:
    """bench/nemesis.py, seed 4: an agent "moved" back to the server it left
    (its pool held that address twice after an earlier move)."""
    async with NatsCluster(tmp_path / "c") as cluster:
        nc = await nats.connect(cluster.urls()[0], reconnect_time_wait=0)
        try:
            await eventually(lambda: len(nc._server_pool) == 3, "the members discovered")
            members = _addresses(nc)
            for _ in range(8):
                before = _on(nc)
                assert await _natspy.move_to_another_server(nc, within_s=5.0)
                assert _on(nc) != before
                assert _addresses(nc) == members  # each address once
        finally:
            await nc.close()


async def test_move_tries_every_other_server_within_its_time(tmp_path: Path) -> None:
    """bench/nemesis.py, seed 4: a move gave its one try a second and found no
    other server. Two frozen servers (SIGSTOP: the kernel takes the TCP
    connection, no INFO comes) stand before the live one in the pool."""
    async with (
        NatsServer(tmp_path / "a") as a,
        NatsServer(tmp_path / "x") as x,
        NatsServer(tmp_path / "y") as y,
        NatsServer(tmp_path / "b") as b,
    ):
        nc = await nats.connect([a.url, x.url, y.url, b.url], dont_randomize=True)
        # Which server is which, for a failure's message: suite runs at 4 workers
        # found the client on a frozen one after a move (twice in six runs).
        name = {urlparse(s.url).netloc: n for n, s in zip("axyb", (a, x, y, b), strict=True)}
        moves = [name.get(_on(nc), _on(nc))]
        frozen = [x, y]
        for server in frozen:
            assert server.proc is not None
            os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            for _ in range(2):
                loop = asyncio.get_running_loop()
                started = loop.time()
                assert await _natspy.move_to_another_server(nc, within_s=MOVE_WITHIN_S)
                moves.append(name.get(_on(nc), _on(nc)))
                assert moves[-1] in {"a", "b"}, (
                    f"on {moves} (x, y frozen), pool {[name.get(u, u) for u in _addresses(nc)]}"
                )
                assert loop.time() - started < MOVE_WITHIN_S + NEVER_S
                assert nc.options["connect_timeout"] == 2  # nats-py's default, put back
        finally:
            for server in frozen:
                assert server.proc is not None
                os.kill(server.proc.pid, signal.SIGCONT)
            await nc.close()


# --- js._nc ---------------------------------------------------------------------


def test_upstream_jetstream_context_has_no_public_connection() -> None:
    nc = Client()
    js = nc.jetstream()
    public = {a for a in dir(js) if not a.startswith("_")}
    assert not public & {"nc", "conn", "client", "connection"}, public
    assert js._nc is nc
    assert _natspy.client_of(js) is nc


# --- micro's error counts ---------------------------------------------------------


def test_upstream_add_endpoint_returns_nothing() -> None:
    from nats.micro.service import Service

    assert inspect.signature(Service.add_endpoint).return_annotation in (None, "None")


async def test_upstream_micro_counts_only_raised_errors(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    svc = await add_service(nc, ServiceConfig(name="pin", version="0.0.1"))

    async def answer_error(req: Request) -> None:
        await req.respond_error("400", "refused", data=b'{"error": {}}')

    await svc.add_endpoint(EndpointConfig(name="e", subject="pin.e", handler=answer_error))
    await nc.request("pin.e", b"", timeout=2)
    [stats] = svc.stats().endpoints
    assert (stats.num_requests, stats.num_errors, stats.last_error) == (1, 0, None)

    _natspy.count_endpoint_error(_natspy.last_endpoint(svc), "400: refused")
    [stats] = svc.stats().endpoints
    assert (stats.num_errors, stats.last_error) == (1, "400: refused")
    await svc.stop()
    await nc.close()


async def test_upstream_stream_info_drops_the_servers_time(nats_server: NatsServer) -> None:
    """nats-py's StreamInfo has no `ts`; `subjects_at` reads it (the
    sweeper's ages are on the server's clock)."""
    assert "ts" not in {f.name for f in dataclasses.fields(StreamInfo)}
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name="PIN_TS", subjects=["pin.ts.>"])
    ack = await js.publish("pin.ts.a", b"x")
    subjects, server_now = await _natspy.subjects_at(js, "PIN_TS", "pin.ts.>")
    stored = (await js.get_msg("PIN_TS", ack.seq)).time
    assert subjects == {"pin.ts.a": 1}
    assert server_now is not None and stored is not None
    assert dt.timedelta(0) <= server_now - stored < dt.timedelta(seconds=5)
    await nc.close()


#: The most subjects nats-server's stream info answers at once (JSMaxSubjectDetails).
SUBJECTS_PAGE = 100_000


async def test_subjects_past_the_servers_page_are_read_page_by_page(
    nats_server: NatsServer,
) -> None:
    """Upstream's stream info stops at the server's page; `subject_counts`
    (every listing of keys, objects and deliveries) reads on to the total."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(name="PIN_PAGES", subjects=["p.>"])
    n = SUBJECTS_PAGE + 3
    try:
        for i in range(n):  # no ack each: 100,003 acknowledged publishes take a minute
            await nc.publish(f"p.{i}", b"")
            if i % 10_000 == 0:
                await nc.flush()
        await nc.flush()

        async def stored() -> bool:
            return (await js.stream_info("PIN_PAGES")).state.messages == n

        await eventually(stored, f"{n} messages stored", timeout_s=60)
        upstream = await js.stream_info("PIN_PAGES", subjects_filter="p.>")
        assert len(upstream.state.subjects or {}) == SUBJECTS_PAGE
        subjects = await _natspy.subject_counts(js, "PIN_PAGES", "p.>")
        assert len(subjects) == n and set(subjects.values()) == {1}
        assert {"p.0", f"p.{n - 1}"} <= set(subjects)
    finally:
        await nc.close()


# --- the socket read size ----------------------------------------------------------


def test_upstream_read_size_is_a_module_global_with_no_option(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not {"buffer_size", "read_buffer_size", "read_size"} & set(
        inspect.signature(Client.connect).parameters
    )
    assert nats.aio.client.DEFAULT_BUFFER_SIZE == 32 * 1024
    assert "DEFAULT_BUFFER_SIZE" in inspect.getsource(Client._read_loop)

    monkeypatch.setattr(nats.aio.client, "DEFAULT_BUFFER_SIZE", 32 * 1024)
    _natspy.use_read_buffer(1 << 20)
    assert nats.aio.client.DEFAULT_BUFFER_SIZE == 1 << 20
    _natspy.use_read_buffer(1024)
    assert nats.aio.client.DEFAULT_BUFFER_SIZE == 1 << 20, "never lowered"


# --- publish_async and a refused publish --------------------------------------------


def test_upstream_api_error_from_error_raises_instead_of_returning() -> None:
    with pytest.raises(nats.js.errors.BadRequestError):
        nats.js.errors.APIError.from_error(
            {"code": 400, "err_code": 10077, "description": "maximum messages exceeded"}
        )


async def test_upstream_publish_async_never_ends_a_refused_publish(
    nats_server: NatsServer,
) -> None:
    nc, errors = await _errors_collected(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(name="PIN", subjects=["pin.>"], max_msgs=1, discard=DiscardPolicy.NEW)
    )
    await js.publish("pin.a", b"1")

    theirs = await js.publish_async("pin.a", b"2")
    async with _natspy.AsyncPublisher(nc) as pub:
        ours = await pub.publish("pin.a", b"2")
        with pytest.raises(_natspy.PublishRefusedError) as refused:
            await asyncio.wait_for(ours, 5)
        assert "maximum messages" in refused.value.description
        ok = await pub.publish("other.x", b"")
        with pytest.raises(_natspy.NoStreamError):
            await asyncio.wait_for(ok, 5)
    # The refusal reached nats-py's reply callback and escaped from it.
    await eventually(lambda: errors, "nats-py's reply callback raised the refusal")
    assert isinstance(errors[0], nats.js.errors.APIError), errors
    await asyncio.sleep(NEVER_S)
    assert not theirs.done(), "publish_async now ends a refused publish: drop AsyncPublisher"
    theirs.cancel()
    await nc.close()


async def test_async_publisher_acknowledges_with_the_stream_sequence(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name="PIN", subjects=["pin.>"]))
    pub = await _natspy.AsyncPublisher(nc).start()
    first = await pub.publish("pin.a", b"1")
    second = await pub.publish("pin.a", b"2", headers={"Nats-Msg-Id": "two"})
    assert await asyncio.wait_for(asyncio.gather(first, second), 5) == [1, 2]
    pending = await pub.publish("pin.a", b"3")
    pending.cancel()
    await pub.stop()
    await nc.close()


# --- object-store reads -------------------------------------------------------------------


async def _api_subjects_during(nc: Client, spy: Client, action: object) -> set[str]:
    """The JetStream API subjects `nc` requested on the server while `action` ran.

    nc publishes a mark before and after it, and the spy waits to see each:
    the server delivers one client's messages in the order sent, so what the
    spy saw between the two marks is all of it, however late its callback runs."""
    seen: set[str] = set()
    marks = {"spy.begin": asyncio.Event(), "spy.end": asyncio.Event()}

    async def note(msg: Msg) -> None:
        if msg.subject in marks:
            marks[msg.subject].set()
        elif marks["spy.begin"].is_set() and msg.subject.startswith("$JS.API."):
            seen.add(msg.subject)

    sub = await spy.subscribe(">", cb=note)
    await spy.flush()
    for _ in range(50):  # the subscription may reach the server after a first mark
        await nc.publish("spy.begin")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(marks["spy.begin"].wait(), 0.2)
            break
    assert marks["spy.begin"].is_set(), "the spy never saw nc's mark"
    assert inspect.isawaitable(action)
    await action
    await nc.publish("spy.end")
    await asyncio.wait_for(marks["spy.end"].wait(), 30)
    await sub.unsubscribe()
    return seen


async def test_upstream_object_get_needs_stream_lookup_info_and_a_consumer(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    spy = await nats.connect(nats_server.url)
    js = nc.jetstream()
    obs = await js.create_object_store("pin")
    content = bytes(range(256)) * 20
    await obs.put("o", content)

    theirs = await _api_subjects_during(nc, spy, obs.get("o"))
    assert "$JS.API.STREAM.NAMES" in theirs, theirs
    assert any(s.startswith("$JS.API.CONSUMER.CREATE.OBJ_pin") for s in theirs), theirs

    out = io.BytesIO()
    ours = await _api_subjects_during(nc, spy, _natspy.read_object(js, "pin", "o", out))
    assert ours == set(object_read_subjects("pin"))
    assert out.getvalue() == content
    await spy.close()
    await nc.close()


async def test_read_object_batches_direct_gets_and_falls_back_to_message_gets(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many chunks, a few batches; a stream without allow_direct (no one
    answers a direct get) is read whole by message gets instead."""
    monkeypatch.setattr(_direct_get, "DIRECT_GET_BATCH", 3)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    content = os.urandom(10 * 1024 + 7)  # 11 chunks of 1 KiB: 3 + 3 + 3 + 2
    direct = await js.create_object_store("direct")
    await direct.put("o", content, meta=nats.js.api.ObjectMeta(
        options=nats.js.api.ObjectMetaOptions(max_chunk_size=1024)))  # fmt: skip
    await js.add_stream(StreamConfig(
        name="OBJ_plain", subjects=["$O.plain.C.>", "$O.plain.M.>"], allow_rollup_hdrs=True,
        allow_direct=False,
    ))  # fmt: skip
    plain = await js.object_store("plain")
    await plain.put("o", content, meta=nats.js.api.ObjectMeta(
        options=nats.js.api.ObjectMetaOptions(max_chunk_size=1024)))  # fmt: skip
    for bucket, sizes in (("direct", [3, 3, 3, 2]), ("plain", [1] * 11)):
        out = io.BytesIO()
        assert await _natspy.read_object_sha256(js, bucket, "o", out) == (
            len(content),
            hashlib.sha256(content).hexdigest(),
        )
        assert out.getvalue() == content, bucket
        info = await (await js.object_store(bucket)).get_info("o")
        subject = names.object_chunk_subject(bucket, info.nuid or "")
        async with _direct_get.SubjectReader(js, nc, f"OBJ_{bucket}", subject) as reader:
            got = [
                len(await reader.next_batch(11 - n)) for n in itertools.accumulate([0, *sizes[:-1]])
            ]
            assert (got, reader.direct) == (sizes, bucket == "direct")
    await nc.close()


async def test_read_object_refuses_missing_deleted_and_damaged_objects(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    obs = await js.create_object_store("pin")
    with pytest.raises(_natspy.ObjectNotFoundError):
        await _natspy.read_object(js, "pin", "none", io.BytesIO())
    await obs.put("gone", b"x")
    await obs.delete("gone")
    with pytest.raises(_natspy.ObjectNotFoundError, match="deleted"):
        await _natspy.read_object(js, "pin", "gone", io.BytesIO())
    info = await obs.put("cut", b"y" * 100)
    await js.purge_stream("OBJ_pin", subject=f"$O.pin.C.{info.nuid}")
    with pytest.raises(_natspy.ObjectDamagedError, match="read 0 bytes"):
        await _natspy.read_object(js, "pin", "cut", io.BytesIO())
    await nc.close()


def test_upstream_object_get_appends_to_immutable_bytes() -> None:
    assert "writeinto" in inspect.signature(ObjectStore.get).parameters
    result = ObjectStore.ObjectResult(info=None)  # type: ignore[arg-type]
    assert type(result.data) is bytes, "get now grows a mutable buffer: plain get may do"
    assert "result.data += msg.data" in inspect.getsource(ObjectStore.get)


async def test_download_object_writes_every_chunk(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    obs = await js.create_object_store("pin")
    content = bytes(range(256)) * 40
    meta = nats.js.api.ObjectMeta(
        name="o", options=nats.js.api.ObjectMetaOptions(max_chunk_size=SMALL_CHUNK_BYTES)
    )
    info = await obs.put("o", content, meta=meta)
    assert (info.chunks or 0) > 1
    out = io.BytesIO()
    assert await _natspy.download_object(js, "pin", "o", out) == hashlib.sha256(content).hexdigest()
    assert out.getvalue() == content
    await obs.put("empty", b"")
    assert await _natspy.download_object(js, "pin", "empty", io.BytesIO()) == (
        hashlib.sha256(b"").hexdigest()
    )
    with pytest.raises(nats.js.errors.ObjectNotFoundError):
        await _natspy.download_object(js, "pin", "none", io.BytesIO())
    await nc.close()


async def test_upstream_object_get_waits_for_ever_for_a_missing_chunk(
    nats_server: NatsServer,
) -> None:
    """Seed 4 of bench/nemesis.py: an info whose chunks are gone hung the run's
    final download. download_object counts them first and names the missing."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    obs = await js.create_object_store("pin")
    info = await obs.put("cut", b"y" * 100)
    await js.purge_stream("OBJ_pin", subject=f"$O.pin.C.{info.nuid}")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(obs.get("cut", writeinto=io.BytesIO()), NEVER_S)
    with pytest.raises(
        _natspy.ObjectChunksMissingError, match=r"1 of its 1 chunks missing .* holds 0"
    ):
        await _natspy.download_object(js, "pin", "cut", io.BytesIO())
    await nc.close()


# --- creating an object store from its config ----------------------------------------


async def test_upstream_create_object_store_ignores_the_config_bucket(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    with pytest.raises(TypeError):
        await js.create_object_store(config=ObjectStoreConfig(bucket="pin"))
    await _natspy.create_object_store(js, ObjectStoreConfig(bucket="pin", description="d"))
    obs = await js.object_store("pin")
    assert (await obs.status()).description == "d"
    await nc.close()


# --- refusals reach the error callback only --------------------------------------------


async def test_upstream_refused_publish_does_not_raise(tmp_path: Path) -> None:
    config = tmp_path / "nats.conf"
    perms = {"publish": {"allow": ["ok.>"]}, "subscribe": {"allow": ["_INBOX.>"]}}
    config.write_text(passwords.server_config({"u": ("p", perms)}))
    async with NatsServer(tmp_path / "store", config_file=config) as server:
        nc, errors = await _errors_collected(server.url_for("u", "p"))
        await nc.publish("denied.x", b"")  # no exception: the server's -ERR comes later
        await nc.flush()
        await eventually(lambda: errors, "the refusal reached the error callback")
        refused = _natspy.permissions_violation_message(errors[0])
        assert refused is not None and 'publish to "denied.x"' in refused.lower(), errors
        assert not _natspy.is_authorization_violation(errors[0])
        await nc.close()


def test_names_agree_with_nats_py_own_names() -> None:
    """names.py spells NATS's subjects, streams and headers itself (one place
    for every literal); they must stay what nats-py and the server use."""
    from nats.js import client as js_client
    from nats.js import kv, object_store
    from nats.js.api import Header as JsHeader
    from nats.micro import request as micro_request

    assert names.kv_stream("b") == js_client.KV_STREAM_TEMPLATE.format(bucket="b")
    assert names.kv_subject("b", "k") == js_client.KV_PRE_TEMPLATE.format(bucket="b") + "k"
    assert names.object_stream("b") == object_store.OBJ_STREAM_TEMPLATE.format(bucket="b")
    encoded = base64.urlsafe_b64encode(b"a/b").decode()
    assert names.object_meta_subject("b", "a/b") == object_store.OBJ_META_PRE_TEMPLATE.format(
        bucket="b", obj=encoded
    )
    assert names.object_chunk_subject("b", "n") == object_store.OBJ_CHUNKS_PRE_TEMPLATE.format(
        bucket="b", obj="n"
    )
    assert names.object_chunk_subjects("b") == object_store.OBJ_ALL_CHUNKS_PRE_TEMPLATE.format(
        bucket="b"
    )
    assert names.object_meta_subjects("b") == object_store.OBJ_ALL_META_PRE_TEMPLATE.format(
        bucket="b"
    )
    assert names.OBJECT_DIGEST_PREFIX == object_store.OBJ_DIGEST_TYPE
    H = names.Header
    assert JsHeader.MSG_ID.value == H.MSG_ID
    assert JsHeader.EXPECTED_LAST_SUBJECT_SEQUENCE.value == H.EXPECTED_LAST_SUBJECT_SEQUENCE
    assert JsHeader.ROLLUP.value == H.ROLLUP
    assert JsHeader.STATUS.value == H.STATUS
    assert (H.KV_OPERATION, H.MARKER_REASON) == (kv.KV_OP, kv.KV_MARKER_REASON)
    assert (names.KV_DEL, names.KV_PURGE, names.ROLLUP_SUBJECT) == (
        kv.KV_DEL,
        kv.KV_PURGE,
        kv.MSG_ROLLUP_SUBJECT,
    )
    assert (H.SERVICE_ERROR, H.SERVICE_ERROR_CODE) == (
        micro_request.ERROR_HEADER,
        micro_request.ERROR_CODE_HEADER,
    )
    assert Names().node_heartbeat("gpu-1") == "$KV.lorafleet_nodes.gpu-1"
    assert msg_get_subject("d") == "$JS.API.STREAM.MSG.GET.OBJ_d"


async def test_upstream_kv_watcher_keeps_its_subscription_private_and_untimed(
    nats_server: NatsServer,
) -> None:
    # `watch_consumer_info` reads KeyWatcher._sub (no public accessor) and
    # bounds consumer_info itself (it takes no timeout).
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    kv = await js.create_key_value(bucket="pin_watch")
    watcher = await kv.watch(">")
    assert not any(name in dir(watcher) for name in ("sub", "subscription", "consumer_info"))
    assert "timeout" not in inspect.signature(watcher._sub.consumer_info).parameters
    info = await _natspy.watch_consumer_info(watcher, 1.0)
    assert info.stream_name == "KV_pin_watch"
    await watcher.stop()
    await nc.close()


async def test_kv_values_lists_the_current_values_without_deletes(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    kv = await js.create_key_value(bucket="pin_values")
    try:
        assert await _natspy.kv_values(js, kv, "pin_values", "jobs.bob.*", 2.0) == []
        for n in range(25):
            await kv.put(f"jobs.bob.j{n}", f"{n}".encode())
        await kv.put("jobs.bob.j3", b"three")
        await kv.put("jobs.alice.j0", b"hers")
        await kv.delete("jobs.bob.j7")
        got = await _natspy.kv_values(js, kv, "pin_values", "jobs.bob.*", 2.0)
        assert sorted(e.key for e in got) == sorted(f"jobs.bob.j{n}" for n in range(25) if n != 7)
        assert {e.key: e.value for e in got}["jobs.bob.j3"] == b"three"
        await kv.delete("jobs.alice.j0")
        assert await _natspy.kv_values(js, kv, "pin_values", "jobs.alice.*", 2.0) == []
        # No consumer made: nemesis seed 47's gateways piled up one per listing
        # until the server refused more.
        assert (await js.stream_info("KV_pin_values")).state.consumer_count == 0
    finally:
        await nc.close()


def test_an_object_digest_reads_back_where_it_is_written() -> None:
    """object_digest writes the object store's digest field and digest_matches
    reads it, in one module; nats-py's own lowercase prefix reads too."""
    import hashlib

    from nats.js.api import ObjectInfo

    sha = hashlib.sha256(b"abc")
    field = _natspy.object_digest(sha.hexdigest())
    assert field.startswith("SHA-256=")

    def info(digest: str | None) -> ObjectInfo:
        return ObjectInfo(name="o", bucket="b", nuid="n", digest=digest)

    assert _natspy.digest_matches(info(field), sha.digest())
    assert _natspy.digest_matches(info(field.replace("SHA-256=", "sha-256=")), sha.digest())
    assert not _natspy.digest_matches(info(field), hashlib.sha256(b"abd").digest())
    assert _natspy.digest_matches(info(None), sha.digest()), "no digest recorded: nothing to check"
