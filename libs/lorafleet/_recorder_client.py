"""The control plane's client of the recorder: jobs read and moved over NATS.

The scheduler and the artifact-store never touch the database; they ask the
recorder, which owns it (`api.jobs.get/list`, `api.models.list`,
`api.adapters.list`, the
internal `store.jobs.transition` and `store.jobs.artifact`). Every state
change is a compare-and-set (`from_state` -> `to_state`); `end_job` is the
one loop that retries one when the job moved on under it, and `lose_job`
(a loss not the job's own: requeue with attempts left, else fail, as
`lorafleet.states.loss_outcome` decides) and `move_job` (the operator's
requeue off a drained node) go through it too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
from nats.aio.client import Client

import lorafleet.nats._bus as bus
from lorafleet.errors import NotFoundError
from lorafleet.names import Names
from lorafleet.states import FINAL, ON_NODE, loss_outcome, moved_message
from lorafleet_schemas.messages import (
    LIST_MAX,
    AdapterList,
    AdapterListRequest,
    ArtifactStoredRequest,
    JobGetRequest,
    JobList,
    JobListRequest,
    JobRecord,
    JobState,
    ModelList,
    ModelListRequest,
    ModelRecord,
    ServingRecord,
    ServingState,
    TransitionReply,
    TransitionRequest,
)

T = TypeVar("T")

#: Compare-and-set attempts when a job keeps changing under a fail or cancel
#: (each loss means another writer moved it: five in a row is a job that
#: changes state faster than a round trip, which lorafleet's jobs do not).
CAS_ATTEMPTS = 5


async def jobs_among(
    list_jobs: Callable[[JobListRequest], Awaitable[list[JobRecord]]],
    ids: Sequence[str],
    request: JobListRequest,
    cap: int = LIST_MAX,
) -> list[JobRecord]:
    """The jobs among `ids` that `request`'s filters match, however many
    `ids` (none for none): asked `cap` ids at a time, so each answer can
    hold every job it was asked about."""
    out: list[JobRecord] = []
    for start in range(0, len(ids), cap):
        batch = list(ids[start : start + cap])
        out.extend(await list_jobs(msgspec.structs.replace(request, ids=batch, limit=cap)))
    return out


async def serving_records(
    list_adapters: Callable[[AdapterListRequest], Awaitable[list[ServingRecord]]],
    job_ids: Sequence[str],
    state: ServingState | None = None,
    cap: int = LIST_MAX,
) -> list[ServingRecord]:
    """The serving records of `job_ids` (in `state`, if given), none cut by
    the recorder's cap: an answer that fills it is asked again in halves."""
    if not job_ids:
        return []
    req = AdapterListRequest(job_ids=list(job_ids), state=state, limit=cap)
    records = await list_adapters(req)
    if len(records) < cap or len(job_ids) == 1:
        return records
    half = len(job_ids) // 2
    return [
        *await serving_records(list_adapters, job_ids[:half], state, cap),
        *await serving_records(list_adapters, job_ids[half:], state, cap),
    ]


@dataclass(frozen=True, slots=True)
class Ended:
    """What `end_job` did: `applied` when this call moved the job, from
    `from_state`; `job` is the job as the recorder last answered (None: it
    does not know the id)."""

    applied: bool
    job: JobRecord | None
    from_state: JobState | None = None


class RecorderClient:
    """Requests to the recorder on an open connection.

    timeout_s: seconds one request waits for its reply.
    no_responders_retry_s: seconds a request no recorder answers is sent
    again (`Settings.no_responders_retry_s`): a recorder's restart is no error.
    """

    def __init__(
        self, nc: Client, names: Names, timeout_s: float, *, no_responders_retry_s: float
    ) -> None:
        self.nc = nc
        self.names = names
        self.timeout_s = timeout_s
        self.no_responders_retry_s = no_responders_retry_s

    async def _request(self, subject: str, message: Any, reply_type: type[T]) -> T:
        return await bus.request(
            self.nc,
            subject,
            message,
            reply_type,
            timeout_s=self.timeout_s,
            no_responders_retry_s=self.no_responders_retry_s,
        )

    async def get_job(self, job_id: str) -> JobRecord | None:
        """The job, or None when the recorder has no job of that id."""
        try:
            return await self._request(self.names.jobs_get, JobGetRequest(id=job_id), JobRecord)
        except NotFoundError:
            return None

    async def list_jobs(self, req: JobListRequest) -> list[JobRecord]:
        return (await self._request(self.names.jobs_list, req, JobList)).jobs

    async def models(self) -> list[ModelRecord]:
        return (await self._request(self.names.models_list, ModelListRequest(), ModelList)).models

    async def adapters(self, req: AdapterListRequest) -> list[ServingRecord]:
        return (await self._request(self.names.adapters_list, req, AdapterList)).adapters

    async def transition(self, req: TransitionRequest) -> TransitionReply:
        """One compare-and-set; `applied` is false when the job had moved on."""
        return await self._request(self.names.store_transition, req, TransitionReply)

    async def artifact_stored(self, req: ArtifactStoredRequest) -> JobRecord:
        return await self._request(self.names.store_artifact, req, JobRecord)

    async def end_job(
        self,
        job: JobRecord | str,
        to_state: JobState,
        message: str,
        *,
        still: Callable[[JobRecord], bool] | None = None,
    ) -> Ended:
        """Move `job` (a record, or an id to read first) from whatever active
        state it is in to `to_state`, retrying a lost race up to CAS_ATTEMPTS.

        It stops, unapplied, when the job is final or unknown, when
        `still(job)` turns false (the caller's reason no longer holds, say
        the job left the node it was failing for), or after CAS_ATTEMPTS
        lost races.
        """
        return await self._move(job, lambda _: (to_state, message), still)

    async def _move(
        self,
        job: JobRecord | str,
        target: Callable[[JobRecord], tuple[JobState, str]],
        still: Callable[[JobRecord], bool] | None,
        moved: bool = False,
    ) -> Ended:
        """The CAS loop of end_job, lose_job and move_job: `target(job)` is
        where the job as last read goes, and with which message."""
        current = await self.get_job(job) if isinstance(job, str) else job
        for _ in range(CAS_ATTEMPTS):
            if current is None or current.state in FINAL:
                break
            if still is not None and not still(current):
                break
            to_state, message = target(current)
            reply = await self.transition(
                TransitionRequest(
                    id=current.id,
                    from_state=current.state,
                    to_state=to_state,
                    message=message,
                    moved=moved,
                )
            )
            if reply.applied:
                return Ended(applied=True, job=reply.job, from_state=current.state)
            current = reply.job
        return Ended(applied=False, job=current)

    async def fail_job(
        self,
        job: JobRecord | str,
        message: str,
        *,
        still: Callable[[JobRecord], bool] | None = None,
    ) -> Ended:
        """`end_job(job, failed, message)`: `message` is what the user reads."""
        return await self.end_job(job, JobState.FAILED, message, still=still)

    async def lose_job(
        self,
        job: JobRecord | str,
        cause: str,
        failed_message: str,
        *,
        still: Callable[[JobRecord], bool] | None = None,
    ) -> Ended:
        """The job was lost by no fault of its own (`cause`, e.g. "node n1 was
        lost"): back to the queue when it has attempts left, else failed with
        `failed_message`. A cancel that came first wins (the CAS is refused).
        `Ended.job.state` says which it was."""

        def on_node(j: JobRecord) -> bool:
            # A job already back on the queue (or never sent) was not lost.
            return j.state in ON_NODE and (still is None or still(j))

        return await self._move(job, lambda j: loss_outcome(j, cause, failed_message), on_node)

    async def move_job(
        self, job: JobRecord, cause: str, *, still: Callable[[JobRecord], bool]
    ) -> Ended:
        """The operator moves `job` off its node (`cause`, e.g. "node n1 was
        drained"): back to the queue whatever its attempts left, its
        max_attempts grown by one (the move is no failure). A cancel that came
        first wins. Only while the job is on a node and `still(job)` holds."""

        def on_node(j: JobRecord) -> bool:
            return j.state in ON_NODE and still(j)

        return await self._move(
            job, lambda j: (JobState.QUEUED, moved_message(j, cause)), on_node, moved=True
        )
