"""In-process stand-ins for the artifact-store's tests: a job record, a
recorder that keeps jobs in a dict, and a clock the test moves."""

from __future__ import annotations

import datetime as dt

import msgspec

from lorafleet._recorder_client import Ended
from lorafleet.errors import BadRequestError
from lorafleet.states import FINAL
from lorafleet_schemas.messages import (
    ArtifactKind,
    ArtifactStoredRequest,
    CheckpointRef,
    Engine,
    JobRecord,
    JobState,
)
from tests.records import job_record


def job(**changes: object) -> JobRecord:
    """Job `job1` on `node-a`, attempt 1, uploading, expecting peft and gguf."""
    now = dt.datetime.now(dt.UTC)
    return job_record(
        **{
            "engine": Engine.LLAMACPP,
            "node": "node-a",
            "gpu_memory_mib": 1,
            "dataset": "d",
            "records": 1,
            "state": JobState.UPLOADING,
            "artifacts_expected": [ArtifactKind.PEFT, ArtifactKind.GGUF],
            "created_at": now,
            "updated_at": now,
            **changes,
        }
    )


class FakeRecorder:
    """The recorder's answers from a dict of jobs; `fail_next_report` makes the
    next `artifact_stored` raise (a recorder that is down), `unanswered_gets`
    that many `get_job` calls (a recorder that does not answer). A checkpoint is
    kept as the job's `checkpoint`, as the recorder keeps it; with
    `refuse_checkpoints`, refused as a recorder that does not know them."""

    def __init__(self, *jobs: JobRecord) -> None:
        self.jobs = {j.id: j for j in jobs}
        self.reports: list[ArtifactStoredRequest] = []
        self.fail_next_report = False
        self.refuse_checkpoints = False
        self.unanswered_gets = 0

    async def get_job(self, job_id: str) -> JobRecord | None:
        if self.unanswered_gets > 0:
            self.unanswered_gets -= 1
            raise TimeoutError("the recorder did not answer")
        return self.jobs.get(job_id)

    async def artifact_stored(self, req: ArtifactStoredRequest) -> JobRecord:
        if self.fail_next_report:
            self.fail_next_report = False
            raise TimeoutError("the recorder did not answer")
        j = self.jobs[req.id]
        if req.kind is ArtifactKind.CHECKPOINT:
            if self.refuse_checkpoints:
                raise BadRequestError(f"job {req.id} makes peft, not checkpoint", "$.kind")
            self.reports.append(req)
            ref = CheckpointRef(
                job_id=req.id, kind=req.kind, step=req.step or 0, attempt=req.attempt or 1,
                object=req.object or "", size=req.size, sha256=req.sha256,
            )  # fmt: skip
            self.jobs[req.id] = msgspec.structs.replace(j, checkpoint=ref)
            return self.jobs[req.id]
        self.reports.append(req)
        j = msgspec.structs.replace(j, artifacts_stored=[*j.artifacts_stored, req.kind])
        self.jobs[req.id] = j
        return j

    async def fail_job(self, job: JobRecord | str, message: str) -> Ended:
        job_id = job if isinstance(job, str) else job.id
        current = self.jobs.get(job_id)
        if current is None or current.state in FINAL:
            return Ended(applied=False, job=current)
        failed = msgspec.structs.replace(current, state=JobState.FAILED, message=message)
        self.jobs[job_id] = failed
        return Ended(applied=True, job=failed, from_state=current.state)


class FakeClock:
    """Seconds, moved by the test (`clock.now_s += 61`)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s
