"""Retention of the artifacts bucket: which stored adapters and checkpoints
nothing needs any more (the rule: `lorafleet.retention.rules.artifact_removal`).

The judge reads the recorder's view after the bucket was listed: the owners
of the stored artifacts (many jobs a request), the jobs not final that start
from another (`resume_from`), the serving records of the done ones, and the
catalog (a model's default serving policy). A list that comes back full
might have left some out, so the run removes nothing rather than guess.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Sequence

from lorafleet import log
from lorafleet._recorder_client import RecorderClient
from lorafleet.errors import ConflictError, NotFoundError
from lorafleet.log import Event
from lorafleet.objects import ListedObject
from lorafleet.retention._sweep import Judgement, Unneeded
from lorafleet.retention.rules import (
    ArtifactRefs,
    Policy,
    artifact_removal,
    job_of_artifact,
    refusal,
)
from lorafleet.states import ACTIVE
from lorafleet_schemas.messages import (
    LIST_MAX,
    AdapterListRequest,
    ArtifactKind,
    ArtifactStoredRequest,
    JobListRequest,
    JobRecord,
    JobState,
    ServingRecord,
)

#: Jobs asked for in one `jobs.list` (its most).
JOBS_PER_REQUEST = 1000
#: Jobs whose serving records are asked for in one `adapters.list` (of at
#: most 1000 records: a job has one per engine that serves it).
SERVED_JOBS_PER_REQUEST = 50


def _chunks(items: Sequence[str], n: int) -> list[list[str]]:
    return [list(items[i : i + n]) for i in range(0, len(items), n)]


class ArtifactJudge:
    """`lorafleet.retention._sweep.Judge` for the artifacts bucket."""

    def __init__(
        self, recorder: RecorderClient, policy: Policy, clock: Callable[[], dt.datetime]
    ) -> None:
        self.recorder = recorder
        self.policy = policy
        self.clock = clock

    async def __call__(self, objects: Sequence[ListedObject]) -> Judgement:
        owned = [(o, parts) for o in objects if (parts := job_of_artifact(o.name))]
        owners = sorted({job for _, (job, _) in owned})
        jobs: dict[str, JobRecord] = {}
        for ids in _chunks(owners, JOBS_PER_REQUEST):
            for j in await self.recorder.list_jobs(JobListRequest(ids=ids, limit=LIST_MAX)):
                jobs[j.id] = j
        refused = refusal(len(owners), len(jobs), "jobs' artifacts")
        if refused:
            return Judgement(refused=refused)
        active = await self.recorder.list_jobs(
            JobListRequest(states=sorted(ACTIVE), limit=LIST_MAX)
        )
        if len(active) >= LIST_MAX:
            return Judgement(
                refused=f"{LIST_MAX} or more jobs are active: which stored artifacts they "
                "start from cannot be read in one list; nothing was removed"
            )
        resumers = {j.resume_from: j.id for j in active if j.resume_from}
        serving: list[ServingRecord] = []
        done = [j for j in owners if j in jobs and jobs[j].state is JobState.DONE]
        for ids in _chunks(done, SERVED_JOBS_PER_REQUEST):
            found = await self.recorder.adapters(AdapterListRequest(job_ids=ids, limit=LIST_MAX))
            if len(found) >= LIST_MAX:
                return Judgement(refused="a serving list came back full; nothing was removed")
            serving += found
        models = {m.name: m for m in await self.recorder.models()} if done else {}
        refs = ArtifactRefs(jobs=jobs, resumers=resumers, serving=serving, models=models)
        now = self.clock()
        out = []
        for obj, (job_id, kind) in owned:
            reason = artifact_removal(job_id, kind, refs, self.policy, now)
            if reason is not None:
                out.append(Unneeded(obj, kind, reason, job_id))
        return Judgement(unneeded=out)

    async def before_remove(self, u: Unneeded) -> bool:
        """The recorder forgets the artifact first (`store.jobs.artifact`,
        `removed`), so no resume or `resume_from` names a removed object;
        it refuses while the job is not final (resumed since it was judged):
        then the artifact stays. A job it does not know has nothing to forget."""
        if u.job_id is None:
            return True
        req = ArtifactStoredRequest(
            id=u.job_id, kind=ArtifactKind(u.kind), size=u.obj.size, sha256=_UNREAD_SHA256,
            removed=True,
        )  # fmt: skip
        try:
            await self.recorder.artifact_stored(req)
        except NotFoundError:
            return True
        except ConflictError as e:
            log.get().info(Event.RETENTION_REFUSED, object=u.obj.name, error=str(e))
            return False
        return True


#: The sha256 a `removed` request carries (the recorder does not read it).
_UNREAD_SHA256 = "0" * 64
