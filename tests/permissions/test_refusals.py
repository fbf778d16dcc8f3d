"""With node-1's credentials a client can do node-1's work and nothing of node-2's:
the server refuses (the error callback hears "Permissions Violation") and
nothing lands in the streams, the KV or a listener."""

from __future__ import annotations

import datetime as dt
import hashlib
import io
from collections.abc import AsyncIterator

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client

from lorafleet import objects
from lorafleet.errors import ConnectError
from lorafleet.names import dataset_object_name, object_stream
from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import Heartbeat
from tests.eventually import eventually
from tests.permissions.conftest import Fleet

#: Seconds a refused request waits (the server never answers it).
REFUSED_WAIT_S = 0.5


def beat(node: str) -> bytes:
    now = dt.datetime.now(dt.UTC)
    return bus.encode(
        Heartbeat(node=node, version="test", started_at=now, time=now, heartbeat_s=0.5, ttl_s=3)
    )


#: Seconds a refusal has to reach the client's error callback or the server's log.
REFUSAL_TIMEOUT_S = 2.0
#: Seconds between two looks for it.
REFUSAL_INTERVAL_S = 0.02


async def refused(refusals: list[str], verb: str, subject: str) -> str:
    """The server's refusal of `verb` ("Publish to" / "Subscription to") on `subject`,
    as the error callback hears it (nats-py lower-cases the server's -ERR)."""
    want = f'permissions violation for {verb} "{subject}"'.lower()
    matching = await eventually(
        lambda: [text for text in refusals if text.lower() == want],
        f"the server to refuse {want}; refusals: {refusals}",
        timeout_s=REFUSAL_TIMEOUT_S,
        interval_s=REFUSAL_INTERVAL_S,
    )
    return matching[0]


async def server_logged(fleet: Fleet, what: str, subject: str, user: str = "node-1") -> bool:
    """True once the server's own log names `user` and `subject` (exact case); its
    output is read by a task, so the line may come a moment after the client's error."""
    want = f'"$G/user:{user}" - {what} - Subject "{subject}"'
    return await eventually(
        lambda: any(want in line for line in fleet.server.output),
        f"the server to log {want}",
        timeout_s=REFUSAL_TIMEOUT_S,
        interval_s=REFUSAL_INTERVAL_S,
    )


@pytest.fixture
async def service(fleet: Fleet) -> AsyncIterator[Client]:
    nc = await bus.connect(fleet.service_settings(), "test-service")
    await bus.ensure_layout(nc.jetstream(), bus.layout_for(fleet.base))
    yield nc
    await bus.drain_quietly(nc)


async def test_node_1_credentials_reach_node_1_subjects_only(fleet: Fleet, service: Client) -> None:
    names = fleet.base.names
    refusals: list[str] = []
    nc = await bus.connect(fleet.node_settings("node-1"), "node-1", on_refused=refusals.append)
    js = nc.jetstream()
    try:
        # node-1's own work goes through (so a refusal below is the rule, not a broken login).
        ack = await js.publish(names.node_heartbeat("node-1"), beat("node-1"), timeout=2)
        assert ack.seq > 0
        ack = await js.publish(names.status("node-1", "job-a"), b"{}", timeout=2)
        assert ack.stream == names.status_stream

        await another_nodes_publishes_are_refused(fleet, service, nc, refusals)
        await another_nodes_start_subject_is_not_heard(fleet, service, nc, refusals)

        # The recorder's internal API: a listener on it (the service user) hears nothing.
        heard = await service.subscribe(names.store_transition)
        await service.flush()
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(names.store_transition, b"{}", timeout=REFUSED_WAIT_S)
        await refused(refusals, "Publish to", names.store_transition)
        with pytest.raises(nats.errors.TimeoutError):
            await heard.next_msg(timeout=REFUSED_WAIT_S)
    finally:
        await bus.drain_quietly(nc)


async def another_nodes_publishes_are_refused(
    fleet: Fleet, service: Client, nc: Client, refusals: list[str]
) -> None:
    """node-2's heartbeat, status and artifacts, published by node-1: refused, nothing stored."""
    names = fleet.base.names
    js, sjs = nc.jetstream(), service.jetstream()
    for subject in (
        names.node_heartbeat("node-2"),
        names.status("node-2", "job-a"),
        names.artifact_chunks("node-2", "job-a", "peft"),
    ):
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(subject, beat("node-2"), timeout=REFUSED_WAIT_S)
        await refused(refusals, "Publish to", subject)
    # The server's own log names the user and the subject (exact case).
    for subject in (names.node_heartbeat("node-2"), names.status("node-2", "job-a")):
        assert await server_logged(fleet, "Publish Violation", subject)
    kv = await sjs.key_value(names.nodes_bucket)
    assert (await kv.get("node-1")).value is not None
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("node-2")
    for stream, subject in (
        (names.status_stream, names.status("node-2", "job-a")),
        (names.artifacts_stream, names.artifact_chunks("node-2", "job-a", "peft")),
    ):
        with pytest.raises(nats.js.errors.NotFoundError):
            await sjs.get_last_msg(stream, subject)


async def another_nodes_start_subject_is_not_heard(
    fleet: Fleet, service: Client, nc: Client, refusals: list[str]
) -> None:
    """node-2's start subject (and every inbox): node-1's subscription is refused and
    hears nothing; node-1's own start subject is heard."""
    names = fleet.base.names
    own = await nc.subscribe(names.node_start("node-1"))
    other = await nc.subscribe(names.node_start("node-2"))
    snoop = await nc.subscribe("_INBOX.>")
    await nc.flush()
    await refused(refusals, "Subscription to", names.node_start("node-2"))
    await refused(refusals, "Subscription to", "_INBOX.>")
    assert await server_logged(fleet, "Subscription Violation", names.node_start("node-2"))
    await service.publish(names.node_start("node-2"), b"for node-2")
    await service.publish(names.node_start("node-1"), b"for node-1")
    await service.flush()
    assert (await own.next_msg(timeout=2)).data == b"for node-1"
    for sub in (other, snoop):
        with pytest.raises(nats.errors.TimeoutError):
            await sub.next_msg(timeout=REFUSED_WAIT_S)


async def test_node_reads_datasets_with_its_one_api_subject(fleet: Fleet, service: Client) -> None:
    """read_object needs only STREAM.MSG.GET on the datasets stream; nats-py's own
    get (stream lookup and info, a consumer) is refused for a node."""
    names = fleet.base.names
    data = b"".join(b'{"q": "%d", "a": "%d"}\n' % (i, i) for i in range(30000))
    name = dataset_object_name(hashlib.sha256(data).hexdigest())
    store = await service.jetstream().object_store(names.datasets_bucket)
    await store.put(name, data)
    refusals: list[str] = []
    nc = await bus.connect(fleet.node_settings("node-1"), "node-1", on_refused=refusals.append)
    try:
        out = io.BytesIO()
        size = await objects.read_object(nc.jetstream(), names.datasets_bucket, name, out)
        assert size == len(data) > 128 * 1024  # several chunks
        assert out.getvalue() == data
        with pytest.raises(objects.ObjectNotFoundError):
            await objects.read_object(nc.jetstream(), names.datasets_bucket, "sha256/none", out)
        assert refusals == []
        with pytest.raises(nats.errors.TimeoutError):
            await nc.jetstream(timeout=REFUSED_WAIT_S).object_store(names.datasets_bucket)
        await refused(
            refusals,
            "Publish to",
            f"$JS.API.STREAM.INFO.{object_stream(names.datasets_bucket)}",
        )
    finally:
        await bus.drain_quietly(nc)


async def test_a_wrong_password_is_a_connect_error_without_the_password(fleet: Fleet) -> None:
    settings = fleet.base.with_(
        nats_url=fleet.server.url_for("node-1", "not-the-password"), connect_timeout_s=1.0
    )
    with pytest.raises(ConnectError) as e:
        await bus.connect(settings, "node-1")
    assert "Authorization Violation" in str(e.value)
    assert "node-1:***@" in str(e.value)
    assert "not-the-password" not in str(e.value)
