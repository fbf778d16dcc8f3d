"""The lorafleet client library: everything the `lorafleet` command does, as calls.

    async with await Client.connect(Settings.from_env()) as lf:
        await lf.add_model(ModelSpec(name="tiny", engine=Engine.VLLM, local_dir="/models/tiny"))
        job = await lf.submit(JobSpec(model="tiny", gpu_memory_mib=8000, data=ndjson))
        async for event in lf.watch(job.id):
            print(event.job.state, event.job.loss)

Every call is a NATS request to a lorafleet service (docs/api.md); an error
reply raises its `lorafleet.errors.ApiError` subclass, so callers catch by
class. A request nobody answers is sent again for
`settings.no_responders_retry_s`, and a read that timed out once more (the
recorder that held it may have been killed); a write is never sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import io
from collections.abc import AsyncIterator
from pathlib import Path
from types import TracebackType
from typing import TypeVar

import msgspec
from nats.aio.client import Client as Nats

import lorafleet.nats._bus as bus
from lorafleet.estimate import with_architecture
from lorafleet.names import Names, dataset_object_name
from lorafleet.objects import touch_object
from lorafleet.settings import Settings
from lorafleet.states import FINAL
from lorafleet_schemas.messages import (
    AdapterKey,
    AdapterList,
    AdapterListRequest,
    AdapterServeRequest,
    AdapterUnserveReply,
    AdapterUnserveRequest,
    ArtifactGetRequest,
    ArtifactKind,
    ArtifactList,
    ArtifactListRequest,
    ArtifactRecord,
    GcReport,
    GcRequest,
    JobCancelRequest,
    JobCurve,
    JobCurveRequest,
    JobDeleteRequest,
    JobEstimate,
    JobEstimateRequest,
    JobEvent,
    JobGetRequest,
    JobList,
    JobListRequest,
    JobRecord,
    JobResumeRequest,
    JobSpec,
    JobState,
    ModelList,
    ModelListRequest,
    ModelRecord,
    ModelSpec,
    NodeInfo,
    NodeList,
    NodeListRequest,
    NodeSchedule,
    NodeScheduleRequest,
    NodeServeReply,
    ServingRecord,
    ServingState,
)

T = TypeVar("T")

#: Records up to this size go inline in a submit (one message holds them);
#: larger go to the datasets bucket first and the submit names them.
INLINE_DATA_MAX_BYTES = 512 * 1024
#: Seconds a retention run (`gc`) may take: it reads every object's info.
GC_TIMEOUT_S = 120.0


def job_order(job: JobRecord) -> tuple[int, dt.datetime]:
    """What orders records of one job, oldest first: the recorder's version
    of it (its updated_at can run backwards, see JobRecord.version), then
    the time, which alone orders records of a recorder that sends no version."""
    return job.version, job.updated_at


class JobFailedError(RuntimeError):
    """A job that was waited for ended failed or cancelled."""

    def __init__(self, job: JobRecord) -> None:
        super().__init__(f"job {job.id} ended {job.state.value}: {job.message}")
        self.job = job


class Client:
    """A connection to a lorafleet installation. Create with `await Client.connect(...)`."""

    def __init__(self, nc: Nats, settings: Settings) -> None:
        self.nc = nc
        self.settings = settings
        self.names: Names = settings.names
        self.js = nc.jetstream()

    @classmethod
    async def connect(
        cls, settings: Settings | None = None, name: str = "lorafleet-client"
    ) -> Client:
        settings = settings or Settings.from_env()
        return cls(await bus.connect(settings, name), settings)

    async def close(self) -> None:
        await bus.drain_quietly(self.nc)

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _req(
        self,
        subject: str,
        message: object,
        reply_type: type[T],
        *,
        idempotent: bool = False,
        timeout_s: float | None = None,
    ) -> T:
        return await bus.request(
            self.nc,
            subject,
            message,
            reply_type,
            timeout_s=timeout_s or self.settings.request_timeout_s,
            no_responders_retry_s=self.settings.no_responders_retry_s,
            idempotent=idempotent,
        )

    async def _read(self, subject: str, message: object, reply_type: type[T]) -> T:
        """A request that changes nothing: sent again once when it times out."""
        return await self._req(subject, message, reply_type, idempotent=True)

    # --- catalog ---
    async def add_model(self, spec: ModelSpec, *, read_architecture: bool = True) -> ModelRecord:
        """Add a catalog entry. BadRequestError for an incomplete spec,
        ConflictError when the name is taken by a different entry.

        Without spec.architecture it is read from config.json in local_dir or
        in this machine's Hugging Face cache when there (nothing is
        downloaded); else the model is added without one and its jobs get no
        memory estimate (the record's architecture is None)."""
        if read_architecture:
            spec, _ = with_architecture(spec)
        return await self._req(self.names.models_add, spec, ModelRecord)

    async def models(self) -> list[ModelRecord]:
        return (await self._read(self.names.models_list, ModelListRequest(), ModelList)).models

    # --- data ---
    async def upload_dataset(self, data: bytes) -> str:
        """Put NDJSON into the datasets bucket under its sha256; returns the object name."""
        name = dataset_object_name(hashlib.sha256(data).hexdigest())
        store = await self.js.object_store(self.names.datasets_bucket)
        # The name is the content's sha256: a stored one is this data already
        # (touched, so that a retention sweep that judged it keeps it: see
        # lorafleet.objects). Putting it again would also purge the old
        # chunks, which a client identity may not do (client_permissions).
        if await touch_object(self.js, self.names.datasets_bucket, name):
            return name
        await store.put(name, io.BytesIO(data))
        return name

    async def with_data(
        self, spec: JobSpec, data: bytes, eval_data: bytes | None = None
    ) -> JobSpec:
        """`spec` with its training data and its evaluation set (if any), each
        inline (`data`, `eval_data`) up to INLINE_DATA_MAX_BYTES, else
        uploaded and named (`dataset`, `eval_dataset`)."""
        fields: dict[str, str] = {}
        sets = (("data", "dataset", data), ("eval_data", "eval_dataset", eval_data))
        for inline, named, records in sets:
            if records is None:
                continue
            if len(records) > INLINE_DATA_MAX_BYTES:
                fields[named] = await self.upload_dataset(records)
            else:
                fields[inline] = records.decode()
        return msgspec.structs.replace(spec, **fields)

    # --- jobs ---
    async def submit(self, spec: JobSpec) -> JobRecord:
        """Queue a job. NotFoundError when its model (or dataset object) is
        unknown, BadRequestError when its data or parameters are wrong."""
        return await self._req(self.names.jobs_submit, spec, JobRecord)

    async def estimate(self, request: JobEstimateRequest) -> JobEstimate:
        """The memory estimate of a job, nothing queued: its lines, or the reason
        there is none (`estimate` None), and whether gpu_memory_mib fits it.
        NotFoundError for an unknown model."""
        return await self._read(self.names.jobs_estimate, request, JobEstimate)

    async def get(self, job_id: str) -> JobRecord:
        """The job as the recorder holds it; NotFoundError for an unknown id."""
        return await self._read(self.names.jobs_get, JobGetRequest(id=job_id), JobRecord)

    async def jobs(self, request: JobListRequest | None = None) -> list[JobRecord]:
        return (await self._read(self.names.jobs_list, request or JobListRequest(), JobList)).jobs

    async def curve(self, job_id: str) -> JobCurve:
        """The job's loss curve; NotFoundError for an unknown id."""
        return await self._read(self.names.jobs_curve, JobCurveRequest(id=job_id), JobCurve)

    async def cancel(self, job_id: str, reason: str = "") -> JobRecord:
        """Cancel the job (a final one is returned as it is). NotFoundError
        for an unknown id; ConflictError when it kept changing state (send
        the cancel again)."""
        return await self._req(
            self.names.jobs_cancel, JobCancelRequest(id=job_id, reason=reason), JobRecord
        )

    async def delete(self, job_id: str, reason: str = "") -> JobRecord:
        """Forget a final job (api.jobs.delete); returns its record as it was.
        Retention then removes its artifacts and the data only it named."""
        return await self._req(
            self.names.jobs_delete, JobDeleteRequest(id=job_id, reason=reason), JobRecord
        )

    async def resume(self, job_id: str, attempts: int = 1, reason: str = "") -> JobRecord:
        """Queue a failed or cancelled job again from its newest checkpoint, as
        a new attempt, with `attempts` attempts left. NotFoundError for an
        unknown id; ConflictError for a job that is not failed or cancelled,
        or has no checkpoint (the message says what to do instead: a new job
        with resume_from starts from its adapter)."""
        return await self._req(
            self.names.jobs_resume,
            JobResumeRequest(id=job_id, attempts=attempts, reason=reason),
            JobRecord,
        )

    async def watch(self, job_id: str, poll_s: float = 2.0) -> AsyncIterator[JobEvent]:
        """Events of one job until it is final. The current state comes first;
        a poll every `poll_s` seconds covers events missed while disconnected."""
        queue: asyncio.Queue[JobEvent] = asyncio.Queue()

        async def on_msg(msg: object) -> None:
            with contextlib.suppress(Exception):
                queue.put_nowait(bus.decode(msg.data, JobEvent))  # type: ignore[attr-defined]

        sub = await self.nc.subscribe(self.names.job_events(job_id), cb=on_msg)
        try:
            current = await self.get(job_id)
            yield JobEvent(kind="state", job=current)
            last = current
            while last.state not in FINAL:
                try:
                    event = await asyncio.wait_for(queue.get(), poll_s)
                except TimeoutError:
                    job = await self.get(job_id)
                    if job_order(job) <= job_order(last):
                        continue
                    changed = job.state != last.state
                    event = JobEvent(kind="state" if changed else "progress", job=job)
                if job_order(event.job) < job_order(last):
                    continue  # older than what we showed
                last = event.job
                yield event
        finally:
            await sub.unsubscribe()

    async def events(self) -> AsyncIterator[JobEvent]:
        """Every job's events as the recorder publishes them, until the caller
        stops iterating (no first read, no poll: what `lorafleet top` adds
        to its snapshots). An undecodable message is skipped."""
        queue: asyncio.Queue[JobEvent] = asyncio.Queue()

        async def on_msg(msg: object) -> None:
            with contextlib.suppress(Exception):
                queue.put_nowait(bus.decode(msg.data, JobEvent))  # type: ignore[attr-defined]

        sub = await self.nc.subscribe(self.names.all_job_events, cb=on_msg)
        try:
            while True:
                yield await queue.get()
        finally:
            await sub.unsubscribe()

    async def wait(
        self, job_id: str, until: frozenset[JobState] = FINAL, timeout_s: float | None = None
    ) -> JobRecord:
        """Wait until the job is in one of `until` (default: any final state)."""

        async def run() -> JobRecord:
            async for event in self.watch(job_id):
                if event.job.state in until:
                    return event.job
            return await self.get(job_id)

        return await asyncio.wait_for(run(), timeout_s)

    # --- nodes ---
    async def nodes(self) -> NodeList:
        return await self._read(self.names.nodes_list, NodeListRequest(), NodeList)

    async def schedule_node(
        self,
        node: str,
        schedule: NodeSchedule,
        *,
        move_training: bool = False,
        force: bool = False,
    ) -> NodeInfo:
        """Cordon (no new training), drain (its replicas placed elsewhere,
        then unloaded there) or open `node` again; the node as it is now.
        Idempotent: marking a node as it is changes nothing. Drained with
        `move_training`, its training jobs resume on other nodes from their
        newest checkpoints (the answer's `moving`, and `staying` with why);
        ConflictError, nothing changed, while one has no checkpoint, unless
        `force` (it starts again from step 0)."""
        request = NodeScheduleRequest(
            node=node, schedule=schedule, move_training=move_training, force=force
        )
        return await self._read(self.names.nodes_schedule, request, NodeInfo)

    # --- serving ---
    async def serve(
        self, job_id: str, node: str | None = None, engine: str | None = None
    ) -> NodeServeReply:
        """Load a done job's adapter into the engines of `node` (None: the node
        it trained on) that serve its model, or into the one at `engine`. The
        reply says which engines the agent took it on for (or why none); each
        outcome follows as a serving record (`adapters`, and a job event of
        kind "serving"). ConflictError for a job not done or without its
        adapter; UnavailableError for a node not alive or not answering."""
        req = AdapterServeRequest(job_id=job_id, node=node, engine=engine)
        return await self._req(self.names.adapters_serve, req, NodeServeReply)

    async def unserve(
        self, job_id: str, node: str | None = None, engine: str | None = None
    ) -> AdapterUnserveReply:
        """Take the job's adapter out of `node`'s engines (None: of every node
        serving it). NotFoundError when it is served nowhere."""
        req = AdapterUnserveRequest(job_id=job_id, node=node, engine=engine)
        return await self._req(self.names.adapters_unserve, req, AdapterUnserveReply)

    async def adapters(
        self,
        job_ids: list[str] | None = None,
        *,
        node: str | None = None,
        model: str | None = None,
        state: ServingState | None = None,
        limit: int = 200,
        after: AdapterKey | None = None,
    ) -> list[ServingRecord]:
        """Serving records matching every filter given, newest change first
        (with `after`: page by page, AdapterListRequest.after)."""
        req = AdapterListRequest(
            job_ids=job_ids or [], node=node, model=model, state=state, limit=limit, after=after
        )
        return await self.list_adapters(req)

    async def list_adapters(self, req: AdapterListRequest) -> list[ServingRecord]:
        """`adapters`, with the request as it is sent."""
        return (await self._read(self.names.adapters_list, req, AdapterList)).adapters

    async def serving_changes(
        self, job_id: str, timeout_s: float, poll_s: float = 2.0
    ) -> AsyncIterator[ServingRecord]:
        """The job's serving records as they change (each version once, oldest
        change first) until it has one and none is `loading`, or `timeout_s`
        passes. The job's events wake it; a read every `poll_s` seconds covers
        a missed one. An engine whose first report comes after the others
        settled is not waited for."""
        wake = asyncio.Event()

        async def on_msg(_msg: object) -> None:
            wake.set()

        sub = await self.nc.subscribe(self.names.job_events(job_id), cb=on_msg)
        seen: dict[tuple[str, str, str], int] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while True:
                wake.clear()
                records = await self.adapters([job_id])
                for r in sorted(records, key=lambda r: r.updated_at):
                    key = (r.node, r.engine, r.served_name)
                    if seen.get(key, -1) < r.version:
                        seen[key] = r.version
                        yield r
                if records and all(r.state != ServingState.LOADING for r in records):
                    return
                left_s = deadline - loop.time()
                if left_s <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(wake.wait(), min(poll_s, left_s))
        finally:
            await sub.unsubscribe()

    # --- artifacts ---
    async def artifacts(self, job_id: str) -> list[ArtifactRecord]:
        reply = await self._read(
            self.names.artifacts_list, ArtifactListRequest(job_id=job_id), ArtifactList
        )
        return reply.artifacts

    async def artifact(self, job_id: str, kind: ArtifactKind) -> ArtifactRecord:
        """One stored artifact; NotFoundError when the job has none of `kind`."""
        return await self._read(
            self.names.artifacts_get, ArtifactGetRequest(job_id=job_id, kind=kind), ArtifactRecord
        )

    async def gc(self, dry_run: bool = False) -> list[GcReport]:
        """One retention run of each bucket (docs/operations.md, "Retention"):
        the artifacts' report (the artifact-store's), then the datasets' (the
        recorder's). `dry_run`: what would go, removing nothing."""
        req = GcRequest(dry_run=dry_run)
        return [
            await self._req(subject, req, GcReport, timeout_s=GC_TIMEOUT_S)
            for subject in (self.names.artifacts_gc, self.names.datasets_gc)
        ]

    async def download(self, job_id: str, kind: ArtifactKind, out_file: Path) -> ArtifactRecord:
        """Write the artifact into `out_file` and check its sha256 (raises on a mismatch)."""
        from lorafleet.artifacts import download_artifact

        return await download_artifact(self.js, self.names, job_id, kind, out_file)
