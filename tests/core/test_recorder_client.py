"""RecorderClient: its one compare-and-set loop (`end_job`), and its requests
answered by a stand-in recorder on a real nats-server."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from lorafleet._recorder_client import CAS_ATTEMPTS, RecorderClient
from lorafleet.errors import ConflictError, error_body
from lorafleet.names import Names
from lorafleet.nats import _bus as bus
from lorafleet.settings import Settings
from lorafleet_schemas.messages import (
    ErrorCode,
    JobGetRequest,
    JobState,
    TransitionReply,
    TransitionRequest,
)
from tests.scheduler.test_logic import job


class Racing(RecorderClient):
    """A recorder whose job moves on `races` times before a CAS lands."""

    def __init__(self, state: JobState, races: int) -> None:
        super().__init__(None, Names(), 1.0, no_responders_retry_s=0)  # type: ignore[arg-type]
        self.job = job("j1", node="a", state=state)
        self.races = races
        self.sent: list[TransitionRequest] = []

    async def transition(self, req: TransitionRequest) -> TransitionReply:
        self.sent.append(req)
        if req.from_state is not self.job.state:
            return TransitionReply(applied=False, job=self.job)
        if self.races > 0:
            self.races -= 1
            # Another writer got there first: the job moved along its path.
            nxt = {JobState.STARTING: JobState.PREPARING, JobState.PREPARING: JobState.RUNNING}
            self.job = msgspec.structs.replace(
                self.job, state=nxt.get(self.job.state, self.job.state)
            )
            return TransitionReply(applied=False, job=self.job)
        self.job = msgspec.structs.replace(self.job, state=req.to_state, message=req.message)
        return TransitionReply(applied=True, job=self.job)


async def test_end_job_retries_a_lost_race_from_the_state_it_lost_to() -> None:
    rec = Racing(JobState.STARTING, races=2)
    ended = await rec.fail_job(rec.job, "lost")
    assert ended.applied and ended.from_state is JobState.RUNNING
    assert ended.job is not None and ended.job.state is JobState.FAILED
    assert [r.from_state for r in rec.sent] == [
        JobState.STARTING,
        JobState.PREPARING,
        JobState.RUNNING,
    ]


async def test_end_job_gives_up_after_the_attempt_constant() -> None:
    rec = Racing(JobState.STARTING, races=0)

    async def always_moved(req: TransitionRequest) -> TransitionReply:
        rec.sent.append(req)
        return TransitionReply(applied=False, job=rec.job)

    # Every attempt loses (the job changes faster than a round trip).
    rec.transition = always_moved  # type: ignore[method-assign]
    ended = await rec.end_job(rec.job, JobState.CANCELLED, "no")
    assert not ended.applied and len(rec.sent) == CAS_ATTEMPTS


async def test_end_job_stops_at_a_final_job_and_when_its_reason_is_gone() -> None:
    done = Racing(JobState.DONE, races=0)
    ended = await done.fail_job(done.job, "late")
    assert not ended.applied and done.sent == []
    assert ended.job is not None and ended.job.state is JobState.DONE
    moved = Racing(JobState.RUNNING, races=0)
    ended = await moved.fail_job(moved.job, "lost", still=lambda j: j.node == "b")
    assert not ended.applied and moved.sent == []


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[Client]:
    nc = await bus.connect(settings, "recorder-client-test")
    try:
        yield nc
    finally:
        await bus.drain_quietly(nc)


async def test_requests_and_typed_errors_through_a_stand_in_recorder(
    nc: Client, settings: Settings
) -> None:
    names = settings.names
    held = job("j1", node="a", state=JobState.RUNNING)

    async def on_get(msg: Msg) -> None:
        req = msgspec.json.decode(msg.data, type=JobGetRequest)
        if req.id == held.id:
            await msg.respond(msgspec.json.encode(held))
        else:
            await msg.respond(error_body(ErrorCode.NOT_FOUND, f"no job {req.id}", "$.id"))

    async def on_transition(msg: Msg) -> None:
        await msg.respond(error_body(ErrorCode.CONFLICT, "a final state never changes"))

    await nc.subscribe(names.jobs_get, cb=on_get)
    await nc.subscribe(names.store_transition, cb=on_transition)
    rec = RecorderClient(nc, names, timeout_s=2.0, no_responders_retry_s=2.0)
    assert await rec.get_job("j1") == held
    assert await rec.get_job("nope") is None  # NotFoundError means "no such job"
    with pytest.raises(ConflictError, match="a final state never changes"):
        await rec.transition(
            TransitionRequest(id="j1", from_state=JobState.DONE, to_state=JobState.FAILED)
        )
