"""Retention's object operations on a real nats-server (lorafleet.objects):
removal is a compare-and-set on the info a sweep judged, a touch defeats it,
and removing twice does nothing the second time."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Sequence

import pytest
from nats.aio.client import Client

from lorafleet._tasks import stop_tasks
from lorafleet.names import Names, object_chunk_subject, object_stream
from lorafleet.nats._bus import connect, drain_quietly, ensure_layout, layout_for
from lorafleet.objects import (
    ListedObject,
    StagedObject,
    listed_objects,
    remove_object,
    touch_object,
)
from lorafleet.retention._sweep import Judgement, RetentionSweep, Unneeded
from lorafleet.retention.rules import Policy
from lorafleet.settings import Settings
from tests.eventually import eventually

NAMES = Names()
BUCKET = NAMES.datasets_bucket
DATA = b'{"q": "2+2?", "a": "4"}\n'


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[Client]:
    client = await connect(settings, "test-retention-objects")
    await ensure_layout(client.jetstream(), layout_for(settings))
    try:
        yield client
    finally:
        await drain_quietly(client)


async def chunks_held(nc: Client, nuid: str) -> int:
    info = await nc.jetstream().stream_info(
        object_stream(BUCKET), subjects_filter=object_chunk_subject(BUCKET, nuid)
    )
    return sum((info.state.subjects or {}).values())


async def test_remove_takes_the_listed_object_once(nc: Client) -> None:
    js = nc.jetstream()
    await (await js.object_store(BUCKET)).put("sha256/a", io.BytesIO(DATA))
    [obj] = await listed_objects(js, BUCKET)
    assert (obj.name, obj.size) == ("sha256/a", len(DATA))
    assert await chunks_held(nc, obj.nuid) == 1
    assert await remove_object(js, BUCKET, obj)
    assert await listed_objects(js, BUCKET) == []
    assert await chunks_held(nc, obj.nuid) == 0
    # Again (another replica, a retry): nothing to do, nothing raised.
    assert not await remove_object(js, BUCKET, obj)
    assert not await touch_object(js, BUCKET, "sha256/a")


async def test_a_touch_after_the_listing_keeps_it(nc: Client) -> None:
    js = nc.jetstream()
    await (await js.object_store(BUCKET)).put("sha256/a", io.BytesIO(DATA))
    [judged] = await listed_objects(js, BUCKET)
    assert await touch_object(js, BUCKET, "sha256/a")  # a new reference on its way
    assert not await remove_object(js, BUCKET, judged)
    [now] = await listed_objects(js, BUCKET)
    assert now.seq > judged.seq and now.nuid == judged.nuid
    assert await chunks_held(nc, now.nuid) == 1
    assert await (await js.object_store(BUCKET)).get("sha256/a") is not None


async def test_an_upload_of_stored_bytes_touches_them(nc: Client) -> None:
    """The gateway's upload (StagedObject) of bytes stored already keeps the
    stored object and touches it; after a removal it stores its own."""
    js = nc.jetstream()
    await (await js.object_store(BUCKET)).put("sha256/a", io.BytesIO(DATA))
    [judged] = await listed_objects(js, BUCKET)
    async with StagedObject(js, BUCKET) as staged:
        await staged.write(DATA)
        await staged.commit("sha256/a")
    assert not await remove_object(js, BUCKET, judged)
    [kept] = await listed_objects(js, BUCKET)
    assert kept.nuid == judged.nuid
    assert await remove_object(js, BUCKET, kept)
    async with StagedObject(js, BUCKET) as staged:
        await staged.write(DATA)
        await staged.commit("sha256/a")
    [again] = await listed_objects(js, BUCKET)
    assert again.size == len(DATA) and again.nuid != kept.nuid
    assert (await (await js.object_store(BUCKET)).get("sha256/a")).data == DATA


async def test_the_periodic_sweep_removes_after_the_grace(nc: Client) -> None:
    """RetentionSweep.every on a real bucket, with a judge that finds every
    object unneeded: none goes at the first run that finds it, it goes at
    the first run past the grace, and the run's report says so."""
    js = nc.jetstream()
    await (await js.object_store(BUCKET)).put("sha256/a", io.BytesIO(DATA))

    async def judge_all(objects: Sequence[ListedObject]) -> Judgement:
        return Judgement(unneeded=[Unneeded(o, "dataset", "a test's judge") for o in objects])

    sweep = RetentionSweep(js, BUCKET, judge_all, Policy(grace_s=0.5))
    first = await sweep.run()
    assert first.removed == [] and [i.object for i in first.waiting] == ["sha256/a"]
    task = asyncio.create_task(sweep.every(0.1))
    try:
        # Its mark goes once the removal returns, a moment after the bucket
        # lists nothing: a cancel between the two would leave it.
        await eventually(lambda: listed_objects(js, BUCKET), "the sweep to remove it",
                         until=lambda objs: objs == [] and not sweep.marks,
                         timeout_s=10)  # fmt: skip
    finally:
        await stop_tasks(task)
    assert sweep.marks == {}
