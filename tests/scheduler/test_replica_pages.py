"""The replica pass reads every placed job and every serving record, past the
recorder's caps (scheduler/replica_rounds.py): before, it read the newest
1,000 done jobs and 1,000 records, and an older job's replicas were never
placed again. The gateway's model list reads a project's jobs the same way
(`jobs_among`). A recorder with the same paging and caps, and small caps."""

from __future__ import annotations

from typing import cast

import pytest

from lorafleet._recorder_client import RecorderClient, jobs_among, serving_records
from lorafleet_schemas.messages import (
    AdapterListRequest,
    JobListRequest,
    JobRecord,
    JobState,
    ServingRecord,
    ServingState,
)
from lorafleet_services.scheduler import replica_rounds
from lorafleet_services.scheduler.replica_rounds import placed_done_jobs
from tests.records import job_record
from tests.scheduler.test_replicas import record


class Recorder:
    """jobs.list (`after`, `limit`) and adapters.list (`job_ids`, `limit`),
    paged and capped as the recorder's."""

    def __init__(self, jobs: int, records_per_job: int) -> None:
        self.jobs = [job_record(id=f"j{i:03d}") for i in range(jobs)]
        self.records = [
            record(j.id, f"n{k}", ServingState.SERVED)
            for j in self.jobs
            for k in range(records_per_job)
        ]
        self.requests = 0

    async def list_jobs(self, req: JobListRequest) -> list[JobRecord]:
        self.requests += 1
        assert req.placed
        start = 0 if req.after is None else [j.id for j in self.jobs].index(req.after) + 1
        return self.jobs[start : start + req.limit]

    async def adapters(self, req: AdapterListRequest) -> list[ServingRecord]:
        self.requests += 1
        return [
            r for r in self.records
            if r.job_id in req.job_ids and req.state in (None, r.state)
        ][: req.limit]  # fmt: skip


@pytest.fixture
def small_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replica_rounds, "LIST_MAX", 3)
    monkeypatch.setattr(replica_rounds, "MAX_PLACED_PAGES", 3)


@pytest.mark.usefixtures("small_caps")
async def test_every_placed_job_is_read_page_after_page() -> None:
    recorder = Recorder(jobs=7, records_per_job=1)
    jobs, complete = await placed_done_jobs(cast(RecorderClient, recorder))
    assert [j.id for j in jobs] == [j.id for j in recorder.jobs] and complete
    assert recorder.requests == 3  # 3 + 3 + 1


@pytest.mark.usefixtures("small_caps")
async def test_past_the_most_pages_the_pass_says_it_is_not_complete() -> None:
    recorder = Recorder(jobs=10, records_per_job=1)
    jobs, complete = await placed_done_jobs(cast(RecorderClient, recorder))
    assert len(jobs) == 9 and not complete


@pytest.mark.usefixtures("small_caps")
async def test_records_past_the_cap_are_read_in_halves() -> None:
    recorder = Recorder(jobs=5, records_per_job=3)  # 15 records, 4 an answer
    ids = [j.id for j in recorder.jobs]
    records = await serving_records(recorder.adapters, ids, cap=4)
    key = [(r.job_id, r.node) for r in records]
    assert sorted(key) == sorted((r.job_id, r.node) for r in recorder.records)
    assert len(set(key)) == len(key)


async def test_jobs_among_many_ids_are_asked_a_cap_at_a_time() -> None:
    """Before, the gateway's model list asked about a project's newest 1,000
    jobs: a project with more did not see its older models."""
    jobs = [
        job_record(id=f"j{i:03d}", state=JobState.DONE if i % 2 else JobState.QUEUED)
        for i in range(7)
    ]
    asked: list[int] = []

    async def list_jobs(req: JobListRequest) -> list[JobRecord]:
        asked.append(len(req.ids))
        found = [j for j in jobs if j.id in req.ids and req.state in (None, j.state)]
        return found[: req.limit]

    done = JobListRequest(state=JobState.DONE)
    got = await jobs_among(list_jobs, [j.id for j in jobs], done, cap=3)
    assert [j.id for j in got] == [j.id for j in jobs if j.state is JobState.DONE]
    assert asked == [3, 3, 1]
    assert await jobs_among(list_jobs, [], done) == []  # no ids: no jobs, never every job
    assert asked == [3, 3, 1]


async def test_records_are_read_in_one_state_when_asked() -> None:
    recorder = Recorder(jobs=3, records_per_job=2)
    gone = recorder.records[0]
    recorder.records[0] = record(gone.job_id, gone.node, ServingState.UNLOADED)
    ids = [j.id for j in recorder.jobs]
    served = await serving_records(recorder.adapters, ids, ServingState.SERVED, cap=4)
    assert len(served) == 5 and all(r.state is ServingState.SERVED for r in served)
