"""Each nkey identity is refused what its process does not need: the client's
error callback hears the server's "Permissions Violation", the server's own
log names the identity's public key and the subject, and nothing is stored,
delivered or deleted."""

from __future__ import annotations

import contextlib
import io
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from lorafleet import objects
from lorafleet.access.identities import IdentityStore, ensure_fleet
from lorafleet.access.identities import server_config as identities_config
from lorafleet.access.permissions import LAYOUT_OWNERS
from lorafleet.errors import ConnectError
from lorafleet.names import (
    artifact_object_name,
    js_api_subject,
    object_chunk_subject,
    object_meta_subject,
    object_stream,
)
from lorafleet.nats import _bus as bus
from lorafleet.nats._consumer import PullConsumer
from lorafleet_services.recorder.service import consumer_config
from tests.eventually import eventually
from tests.permissions.conftest import IdentityFleet
from tests.permissions.test_refusals import REFUSAL_INTERVAL_S, REFUSAL_TIMEOUT_S, beat, refused

#: Seconds a refused request waits (the server never answers it).
REFUSED_WAIT_S = 0.5
#: A stored artifact the node and the client try to delete or overwrite.
ARTIFACT = b"the adapter, as the artifact-store stored it" * 1000


@dataclass
class Conn:
    label: str
    nc: Client
    public_key: str
    refusals: list[str] = field(default_factory=list)


@dataclass
class Conns:
    fleet: IdentityFleet
    by_label: dict[str, Conn] = field(default_factory=dict)

    def __getitem__(self, label: str) -> Conn:
        return self.by_label[label]

    async def open(self, kind: str, name: str) -> Conn:
        ident = self.fleet.store.load(kind, name)
        refusals: list[str] = []
        settings = self.fleet.settings_for(kind, name)
        nc = await bus.connect(settings, f"test-{kind}-{name}", on_refused=refusals.append)
        conn = Conn(ident.label, nc, ident.public_key, refusals)
        self.by_label[ident.label] = conn
        return conn

    async def refused(self, conn: Conn, verb: str, subject: str) -> None:
        """Refused, as `conn` heard it and as the server logged it (naming its key)."""
        await refused(conn.refusals, verb, subject)
        what = "Publish Violation" if verb == "Publish to" else "Subscription Violation"
        want = f'"$G/nkey:{conn.public_key}" - {what} - Subject "{subject}"'
        await eventually(
            lambda: any(want in line for line in self.fleet.server.output),
            f"the server to log {want}",
            timeout_s=REFUSAL_TIMEOUT_S,
            interval_s=REFUSAL_INTERVAL_S,
        )

    async def request_refused(self, conn: Conn, subject: str, payload: bytes = b"{}") -> None:
        with pytest.raises(nats.errors.TimeoutError):
            await conn.nc.request(subject, payload, timeout=REFUSED_WAIT_S)
        await self.refused(conn, "Publish to", subject)


@pytest.fixture
async def conns(id_fleet: IdentityFleet) -> AsyncIterator[Conns]:
    """A connection per identity; the layout made by its owners, each on its own."""
    out = Conns(id_fleet)
    try:
        for name in ("recorder", "scheduler", "artifact-store"):
            conn = await out.open("service", name)
            await bus.ensure_layout(
                conn.nc.jetstream(), bus.layout_for(id_fleet.base), LAYOUT_OWNERS[name]
            )
        await out.open("client", "cli")
        await out.open("node", "node-1")
        yield out
    finally:
        for conn in out.by_label.values():
            await bus.drain_quietly(conn.nc)


async def test_a_node_reaches_only_its_own_subjects(conns: Conns) -> None:
    names = conns.fleet.base.names
    node = conns["node/node-1"]
    js = node.nc.jetstream()
    assert (await js.publish(names.node_heartbeat("node-1"), beat("node-1"), timeout=2)).seq
    for subject in (names.node_heartbeat("node-2"), names.status("node-2", "job-a")):
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(subject, beat("node-2"), timeout=REFUSED_WAIT_S)
        await conns.refused(node, "Publish to", subject)
    other = await node.nc.subscribe(names.node_start("node-2"))
    await conns.refused(node, "Subscription to", names.node_start("node-2"))
    scheduler = conns["service/scheduler"].nc
    await scheduler.publish(names.node_start("node-2"), b"for node-2")
    await scheduler.flush()
    with pytest.raises(nats.errors.TimeoutError):
        await other.next_msg(timeout=REFUSED_WAIT_S)
    kv = await scheduler.jetstream().key_value(names.nodes_bucket)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("node-2")


async def test_only_a_node_writes_its_heartbeat(conns: Conns) -> None:
    """Not the client, not the scheduler (it only reads the nodes KV), not another node."""
    names = conns.fleet.base.names
    subject = names.node_heartbeat("node-1")
    for label in ("client/cli", "service/scheduler", "service/recorder"):
        conn = conns[label]
        with pytest.raises(nats.errors.TimeoutError):
            await conn.nc.jetstream().publish(subject, beat("node-1"), timeout=REFUSED_WAIT_S)
        await conns.refused(conn, "Publish to", subject)
    kv = await conns["service/scheduler"].nc.jetstream().key_value(names.nodes_bucket)
    with pytest.raises(nats.js.errors.KeyNotFoundError):
        await kv.get("node-1")


async def test_nodes_and_clients_cannot_call_the_internal_store_api(conns: Conns) -> None:
    names = conns.fleet.base.names
    heard = await conns["service/recorder"].nc.subscribe(f"{names.prefix}.store.jobs.*")
    await conns["service/recorder"].nc.flush()
    for label in ("node/node-1", "client/cli"):
        for subject in (names.store_transition, names.store_artifact):
            await conns.request_refused(conns[label], subject)
    with pytest.raises(nats.errors.TimeoutError):
        await heard.next_msg(timeout=REFUSED_WAIT_S)


async def stored_artifact(conns: Conns) -> str:
    """An artifact object the artifact-store put; its name."""
    names = conns.fleet.base.names
    obs = await conns["service/artifact-store"].nc.jetstream().object_store(names.artifacts_bucket)
    name = artifact_object_name("job-a", "peft")
    await obs.put(name, io.BytesIO(ARTIFACT))
    return name


async def test_nodes_and_clients_cannot_delete_or_overwrite_artifacts(conns: Conns) -> None:
    names = conns.fleet.base.names
    bucket = names.artifacts_bucket
    name = await stored_artifact(conns)
    for label in ("node/node-1", "client/cli"):
        conn = conns[label]
        # Overwrite: new chunks and a new info message, as an object put sends them.
        for subject in (object_chunk_subject(bucket, "forged"), object_meta_subject(bucket, name)):
            await conn.nc.publish(subject, b"forged")
            await conns.refused(conn, "Publish to", subject)
        # Delete: purging the object's chunks (what an object delete does).
        purge = js_api_subject("STREAM", "PURGE", object_stream(bucket))
        await conns.request_refused(conn, purge, b'{"filter": "$O.%s.C.>"}' % bucket.encode())
        with contextlib.suppress(Exception):  # nats-py's own delete: refused on the way
            obs = await conn.nc.jetstream(timeout=REFUSED_WAIT_S).object_store(bucket)
            await obs.delete(name)
    # The client can still read it, whole and unchanged.
    client_obs = await conns["client/cli"].nc.jetstream().object_store(bucket)
    got = await client_obs.get(name)
    assert got.data == ARTIFACT
    assert got.info.deleted in (None, False)


async def test_a_node_reads_an_artifact_by_message_gets_only(conns: Conns) -> None:
    """A resumed job's agent fetches its checkpoint as it fetches datasets
    (objects.read_object): allowed, and nothing else on the bucket is."""
    names = conns.fleet.base.names
    name = await stored_artifact(conns)
    node = conns["node/node-1"]
    out = io.BytesIO()
    assert await objects.read_object(node.nc.jetstream(), names.artifacts_bucket, name, out)
    assert out.getvalue() == ARTIFACT
    assert node.refusals == []
    # nats-py's own get needs the stream's info (and a consumer): refused.
    with pytest.raises(nats.errors.TimeoutError):
        await node.nc.jetstream(timeout=REFUSED_WAIT_S).object_store(names.artifacts_bucket)
    info = js_api_subject("STREAM", "INFO", object_stream(names.artifacts_bucket))
    await conns.refused(node, "Publish to", info)


async def test_no_one_but_the_recorder_reads_its_consumer(conns: Conns) -> None:
    names = conns.fleet.base.names
    stream, durable = names.status_stream, names.recorder_consumer
    recorder_js = conns["service/recorder"].nc.jetstream()
    await recorder_js.add_consumer(
        stream, ConsumerConfig(durable_name=durable, ack_policy=AckPolicy.EXPLICIT)
    )
    node_js = conns["node/node-1"].nc.jetstream()
    await node_js.publish(names.status("node-1", "job-a"), b"{}", timeout=2)
    next_subject = js_api_subject("CONSUMER", "MSG", "NEXT", stream, durable)
    info_subject = js_api_subject("CONSUMER", "INFO", stream, durable)
    for label in ("node/node-1", "client/cli", "service/scheduler", "service/artifact-store"):
        conn = conns[label]
        await conns.request_refused(conn, next_subject, b'{"batch": 1}')
        await conns.request_refused(conn, info_subject)
    info = await recorder_js.consumer_info(stream, durable)
    # Nothing was delivered to anyone: the report waits for the recorder.
    assert (info.num_pending, info.num_ack_pending, info.delivered.stream_seq) == (1, 0, 0)


async def test_the_recorder_may_change_its_consumers_ack_wait(conns: Conns) -> None:
    """A consumer made by an older recorder (ack wait 30 s) takes this one's
    on its identity: the update is a create of the same durable."""
    names = conns.fleet.base.names
    recorder = conns["service/recorder"]
    settings = conns.fleet.settings_for("service", "recorder")
    config = consumer_config(settings)
    js = recorder.nc.jetstream()
    await js.add_consumer(names.status_stream, replace(config, ack_wait_s=30.0).consumer_config())
    consumer = PullConsumer(js, config, _ack_all)
    await consumer.start()
    try:
        info = await js.consumer_info(names.status_stream, names.recorder_consumer)
        assert info.config.ack_wait == settings.recorder_ack_wait_s != 30.0
        assert recorder.refusals == []
    finally:
        await consumer.stop()


async def _ack_all(msgs: list[Msg]) -> None:
    for m in msgs:
        await m.ack()


async def test_an_unknown_nkey_is_a_connect_error_naming_its_seed(
    id_fleet: IdentityFleet, tmp_path: Path
) -> None:
    stranger, _ = IdentityStore(tmp_path / "elsewhere").ensure("node", "node-1")
    settings = id_fleet.settings_for("node", "node-1").with_(
        nats_nkey_seed=str(stranger.seed_file), connect_timeout_s=5.0
    )
    with pytest.raises(ConnectError, match=r"refused the nkey in .*elsewhere/node/node-1.nk"):
        await bus.connect(settings, "stranger")


async def test_a_client_without_its_inbox_prefix_is_told_to_set_it(
    id_fleet: IdentityFleet,
) -> None:
    refusals: list[str] = []
    settings = id_fleet.settings_for("client", "cli").with_(nats_inbox_prefix="_INBOX")
    nc = await bus.connect(settings, "no-prefix", on_refused=refusals.append)
    try:
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(id_fleet.base.names.jobs_list, b"{}", timeout=REFUSED_WAIT_S)
        text = await eventually(lambda: refusals, "the inbox subscription to be refused")
        assert "subscription" in text[0].lower()
        assert "LORAFLEET_NATS_INBOX_PREFIX" in bus.permissions_violation_hint(text[0])
        assert "LORAFLEET_NATS_INBOX_PREFIX" not in bus.permissions_violation_hint(
            'Permissions Violation for Publish to "lorafleet.store.jobs.transition"'
        )
    finally:
        await bus.drain_quietly(nc)


async def test_a_node_added_later_joins_after_a_reload_and_no_one_else_notices(
    id_fleet: IdentityFleet, tmp_path: Path
) -> None:
    """`lorafleet auth --node node-3` on a running installation (node-2's seed
    rotated too): new seeds for those two only, the config rewritten, the
    server reloaded (SIGHUP); connected identities stay connected on their
    unchanged keys, node-3 reaches its own subjects, node-2's old key is refused."""
    names = id_fleet.base.names
    recorder = await bus.connect(id_fleet.settings_for("service", "recorder"), "recorder")
    layout = bus.layout_for(id_fleet.base)
    try:
        await bus.ensure_layout(recorder.jetstream(), layout, LAYOUT_OWNERS["recorder"])
        # node-2's seed is rotated at the same time: its file deleted, a new one made.
        old_seed = tmp_path / "node-2-old.nk"
        node2_seed = id_fleet.store.seed_path("node", "node-2")
        old_seed.write_bytes(node2_seed.read_bytes())
        old_seed.chmod(0o600)
        node2_seed.unlink()
        before = {i.label: i.public_key for i in id_fleet.store.all()}
        identities, made = ensure_fleet(id_fleet.store, ["node-2", "node-3"])
        assert sorted(i.label for i in made) == ["node/node-2", "node/node-3"]
        assert {i.label: i.public_key for i in identities if i.label in before} == before
        assert id_fleet.server.config_file is not None
        id_fleet.server.config_file.write_text(identities_config(names, identities))
        assert id_fleet.server.proc is not None
        id_fleet.server.proc.send_signal(signal.SIGHUP)
        await eventually(
            lambda: any("Reloaded server configuration" in ln for ln in id_fleet.server.output),
            "the server to reload its config",
        )
        node3 = await bus.connect(id_fleet.settings_for("node", "node-3"), "node-3")
        try:
            ack = await node3.jetstream().publish(names.status("node-3", "job-a"), b"{}")
            assert ack.stream == names.status_stream
        finally:
            await bus.drain_quietly(node3)
        # node-2's old key stopped working at the reload; its new one works.
        old_node2 = id_fleet.settings_for("node", "node-2").with_(
            nats_nkey_seed=str(old_seed), connect_timeout_s=5.0
        )
        with pytest.raises(ConnectError, match="refused the nkey"):
            await bus.connect(old_node2, "node-2-old")
        await bus.drain_quietly(await bus.connect(id_fleet.settings_for("node", "node-2"), "n2"))
        # The recorder's connection was not dropped by the reload.
        assert recorder.is_connected and recorder.stats["reconnects"] == 0
        await recorder.jetstream().stream_info(names.status_stream)
    finally:
        await bus.drain_quietly(recorder)
