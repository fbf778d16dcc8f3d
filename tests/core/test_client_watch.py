"""Client.watch on a real nats-server, with a stand-in recorder answering
`jobs.get`: which of a job's records it takes, and that it always ends."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncIterator

import msgspec
from nats.aio.msg import Msg

from lorafleet.client import Client
from lorafleet.settings import Settings
from lorafleet_schemas.messages import JobEvent, JobRecord, JobState
from tests.scheduler.test_logic import T0, job


def at(seconds: float, **changes: object) -> JobRecord:
    held = job("j1", node="a", state=JobState.RUNNING)
    return msgspec.structs.replace(held, updated_at=T0 + dt.timedelta(seconds=seconds), **changes)


async def test_a_missed_cancel_stamped_before_the_last_progress_still_ends_the_watch(
    settings: Settings,
) -> None:
    """Found in CI (`watch` never ended): the cancel stamped its time, then
    waited for the row while a status batch committed, so the cancelled
    record is newer (version 8) but earlier (1.9 s) than the last progress
    (version 7, 2 s). Its event is missed here, so the poll must take it."""
    async with await Client.connect(settings) as client:
        current = at(2.0, step=5, version=7)

        async def on_get(msg: Msg) -> None:
            await msg.respond(msgspec.json.encode(current))

        await client.nc.subscribe(client.names.jobs_get, cb=on_get)
        watch = client.watch("j1", poll_s=0.1)
        first = await anext(watch)
        assert first.job.version == 7
        # A late event of an older version, with a later time: not shown.
        stale = JobEvent(kind="progress", job=at(3.0, step=4, version=6))
        await client.nc.publish(client.names.job_events("j1"), msgspec.json.encode(stale))
        current = at(1.9, step=5, state=JobState.CANCELLED, version=8)
        seen = await asyncio.wait_for(_all(watch), 5.0)
    assert [(e.kind, e.job.version) for e in seen] == [("state", 8)]


async def _all(events: AsyncIterator[JobEvent]) -> list[JobEvent]:
    return [e async for e in events]
