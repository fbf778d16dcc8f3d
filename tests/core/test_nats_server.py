"""The harness's nats-server: the pinned release, ready from its output, restartable."""

from __future__ import annotations

import nats
import pytest

from lorafleet.errors import ConnectError
from lorafleet.nats import _bus as bus
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings


async def test_server_is_the_pinned_release_and_restarts_on_its_port(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    version = nc.connected_server_version
    assert (version.major, version.minor) == (2, 15), version
    port = nats_server.port
    await nc.close()
    await nats_server.restart(kill=True)
    assert nats_server.port == port
    nc = await nats.connect(nats_server.url)
    assert nc.is_connected
    await nc.close()


async def test_layout_is_idempotent_and_kv_expiry_leaves_a_marker(settings: Settings) -> None:
    nc = await bus.connect(settings, "test")
    js = nc.jetstream()
    layout = bus.layout_for(settings)
    await bus.ensure_layout(js, layout)
    await bus.ensure_layout(js, layout)
    kv = await js.key_value(settings.names.nodes_bucket)
    watcher = await kv.watch("gpu-1")
    assert await watcher.updates(timeout=2) is None  # initial: nothing
    await js.publish(settings.names.node_heartbeat("gpu-1"), b"beat", msg_ttl=1)
    put = await watcher.updates(timeout=2)
    assert put is not None and put.value == b"beat"
    gone = await watcher.updates(timeout=5)
    assert gone is not None and gone.operation == "PURGE"
    await watcher.stop()
    await nc.close()


async def test_connect_fails_fast_with_a_clear_error() -> None:
    # nats-py alone retries a first connect for minutes; the per-test
    # timeout fails this test if bus.connect does not give up by itself.
    settings = Settings(nats_url="nats://127.0.0.1:9", connect_timeout_s=1)
    with pytest.raises(ConnectError, match="LORAFLEET_NATS_URL"):
        await bus.connect(settings, "test")
