"""Retention in the recorder: the datasets bucket's judge (which training
and evaluation data nothing names any more; the rule:
`lorafleet.retention.rules.dataset_removal`), and the requests retention
makes of the recorder (`RetentionApi`: a job deleted, a removed artifact
forgotten).

The references are read after the bucket was listed, in the order a
reference moves: the gateway's files first, then the jobs table. A job made
from a file (the gateway's `fine_tuning.jobs.create`) is written after the
file was read, and the file may be deleted right after (OpenAI's clients
do: upload, create the job, delete the file). Read the other way round, a
sweep could read the jobs before that job's row and the files after that
file's deletion, and see neither; read files first, the file is seen, or
the job's row is (it was written before the file went), or the job's submit
is still on its way, which the grace and the submit's touch cover
(`lorafleet.retention._sweep`).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import nats.js.errors
from nats.js import JetStreamContext
from sqlalchemy import func, select

from lorafleet import log
from lorafleet.errors import ConflictError, NotFoundError
from lorafleet.log import Event
from lorafleet.names import Names
from lorafleet.nats._natspy import kv_values
from lorafleet.objects import ListedObject
from lorafleet.retention._sweep import Judgement, Unneeded
from lorafleet.retention.rules import DATASET, DatasetUse, Policy, dataset_removal, refusal
from lorafleet_schemas.messages import ArtifactStoredRequest, JobDeleteRequest, JobRecord, JobState
from lorafleet_services.recorder import job_writes, store
from lorafleet_services.recorder.db import Sessions
from lorafleet_services.recorder.job_writes import JobChange
from lorafleet_services.recorder.tables import jobs

#: Seconds the gateway's files take to be read, at most.
FILES_TIMEOUT_S = 10.0


class _GatewayFile(msgspec.Struct):
    """The one field of the gateway's file record (gateway/state.py's
    FileRecord) that retention reads: the object holding its content."""

    dataset: str
    id: str = ""


async def gateway_files(js: JetStreamContext, names: Names) -> dict[str, str]:
    """dataset object -> a gateway file that names it (none without a gateway)."""
    bucket = names.gateway_bucket
    try:
        kv = await js.key_value(bucket)
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
        return {}
    out: dict[str, str] = {}
    for entry in await kv_values(js, kv, bucket, "files.*.*", FILES_TIMEOUT_S):
        f = msgspec.json.decode(entry.value, type=_GatewayFile)
        out.setdefault(f.dataset, f.id or entry.key)
    return out


def _utc(t: dt.datetime) -> dt.datetime:
    return t.replace(tzinfo=dt.UTC) if t.tzinfo is None else t  # SQLite keeps no zone


async def dataset_uses(sm: Sessions) -> tuple[dict[str, DatasetUse], int]:
    """dataset object -> the jobs that name it (as data or evaluation set),
    and how many jobs the table holds."""
    cols = select(
        jobs.c.dataset, jobs.c.eval_dataset, jobs.c.state, jobs.c.finished_at, jobs.c.updated_at
    )
    uses: dict[str, DatasetUse] = {}
    async with sm() as s, s.begin():
        count = int((await s.execute(select(func.count()).select_from(jobs))).scalar() or 0)
        for data, eval_data, state, finished, updated in (await s.execute(cols)).all():
            end = _utc(finished or updated)  # updated_at is NOT NULL
            for name in (data, eval_data):
                if name:
                    uses[name] = uses.get(name, DatasetUse()).add(JobState(state), end)
    return uses, count


class DatasetJudge:
    """`lorafleet.retention._sweep.Judge` for the datasets bucket."""

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        sm: Sessions,
        policy: Policy,
        clock: Callable[[], dt.datetime],
    ) -> None:
        self.js = js
        self.names = names
        self.sm = sm
        self.policy = policy
        self.clock = clock

    async def files(self) -> dict[str, str]:
        return await gateway_files(self.js, self.names)

    async def uses(self) -> tuple[dict[str, DatasetUse], int]:
        return await dataset_uses(self.sm)

    async def __call__(self, objects: Sequence[ListedObject]) -> Judgement:
        files = await self.files()  # first: see the module's doc
        uses, job_count = await self.uses()
        refused = refusal(len(objects), job_count, "datasets")
        if refused:
            return Judgement(refused=refused)
        now = self.clock()
        out = []
        for obj in objects:
            reason = dataset_removal(obj.name, files, uses, self.policy, now)
            if reason is not None:
                out.append(Unneeded(obj, DATASET, reason))
        return Judgement(unneeded=out)


class RetentionApi:
    """`api.jobs.delete`, and `store.jobs.artifact` with `removed`: plain async
    handlers; `publish` sends a committed change as the job's event."""

    def __init__(self, sm: Sessions, publish: Callable[[JobChange], Awaitable[None]]) -> None:
        self.sm = sm
        self.publish = publish
        self.logger = log.get()

    async def jobs_delete(self, req: JobDeleteRequest) -> JobRecord:
        """Forget a final job; retention removes what only it needed."""
        try:
            job = await store.delete_job(self.sm, req.id)
        except store.NoSuchJobError:
            raise NotFoundError(f"no job {req.id}: list jobs with jobs.list", "$.id") from None
        except store.NotDeletableError as e:
            raise ConflictError(str(e), "$.id") from None
        self.logger.info(Event.JOB_DELETED, job_id=job.id, state=job.state.value,
                         reason=req.reason)  # fmt: skip
        return job

    async def forget_artifact(self, req: ArtifactStoredRequest) -> JobRecord:
        """Retention's removal of a stored artifact (`removed`): its reference forgotten."""
        try:
            job, change = await job_writes.forget_artifact(self.sm, req.id, req.kind)
        except store.NoSuchJobError:
            raise NotFoundError(f"no job {req.id}", "$.id") from None
        except store.ArtifactNeededError as e:
            raise ConflictError(str(e), "$.removed") from None
        if change is not None:
            await self.publish(change)
        return job
