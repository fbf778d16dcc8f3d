"""The scheduler's node watch on a real cluster, in-process: it knows when
it is blind, and a dead watch is rebuilt within a second or two."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import structlog
from nats.aio.client import Client

from lorafleet import _runtime as runtime
from lorafleet.names import kv_stream
from lorafleet.nats import _bus as bus
from lorafleet.nats._kv_watch import REBUILD_AFTER_S, KeyWatch
from lorafleet.nats._natspy import watch_consumer_info
from lorafleet.nats.cluster import NatsCluster, stream_leader
from lorafleet.settings import Settings
from tests.eventually import eventually

PROBE_S = 0.25


@pytest.fixture
async def watched(
    nats_cluster: NatsCluster,
) -> AsyncIterator[tuple[Client, KeyWatch, list[tuple[float, bool]]]]:
    settings = Settings(nats_url=nats_cluster.url, replicas=3)
    nc = await bus.connect(settings, "watch-test")
    js = nc.jetstream()
    # Retried: a cluster just ready can time out a replicated creation (seen once in CI).
    await runtime.ensure_layout_retrying(js, settings)
    views: list[tuple[float, bool]] = []
    watch = KeyWatch(
        js,
        settings.names.nodes_bucket,
        ">",
        lambda _e: None,
        structlog.get_logger(),
        probe_s=PROBE_S,
        on_view=lambda seeing: views.append((time.monotonic(), seeing)),
    )
    watch.start()
    await eventually(lambda: watch.seeing, "the watch to see the bucket")
    try:
        yield nc, watch, views
    finally:
        await watch.stop()
        await bus.drain_quietly(nc)


async def test_a_watch_whose_consumer_is_gone_is_rebuilt_at_once(
    watched: tuple[Client, KeyWatch, list[tuple[float, bool]]],
) -> None:
    nc, watch, views = watched
    info = await watch_consumer_info(watch._watcher, 1.0)
    # What the death of the consumer's server does to it, without the server.
    gone_at = time.monotonic()
    await nc.jetstream().delete_consumer(info.stream_name, info.name)
    await eventually(lambda: watch.rebuilds >= 1, "a rebuild", timeout_s=5)
    await eventually(lambda: views and views[-1][1], "the view back", timeout_s=5)
    blind_at, restored_at = views[0][0], views[-1][0]
    assert [seeing for _t, seeing in views] == [True, False, True][-len(views) :]
    assert blind_at - gone_at <= PROBE_S + 0.6, blind_at - gone_at
    assert restored_at - gone_at <= REBUILD_AFTER_S + 1.5, restored_at - gone_at
    fresh = await watch_consumer_info(watch._watcher, 1.0)
    assert fresh.name != info.name


async def test_the_buckets_election_is_blindness_and_ends(
    nats_cluster: NatsCluster, watched: tuple[Client, KeyWatch, list[tuple[float, bool]]]
) -> None:
    nc, _watch, views = watched
    leader = await stream_leader(nc.jetstream(), kv_stream(Settings().names.nodes_bucket))
    await nats_cluster.kill(leader)
    killed_at = time.monotonic()
    blind = await eventually(
        lambda: [t for t, seeing in views if not seeing], "blindness", timeout_s=5
    )
    assert blind[0] - killed_at <= PROBE_S + 0.6, blind[0] - killed_at
    await eventually(lambda: views[-1][1], "the view back, two of three left", timeout_s=30)
