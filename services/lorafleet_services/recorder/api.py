"""The recorder's request handlers and status application, as plain async code.

`RecorderApi` holds what the handlers need: the session factory, the names,
the datasets bucket (behind the small `Datasets` protocol) and a `publish`
function for events. Each method is load -> process -> apply: checks and
object-store reads first, then one short store transaction, then the event
published after commit. service.py binds these methods to NATS subjects.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import msgspec
import sqlalchemy.exc

from lorafleet import estimate, log, metrics, training_data
from lorafleet.errors import BadRequestError, ConflictError, NotFoundError, UnavailableError
from lorafleet.log import Event
from lorafleet.names import Names, dataset_object_name
from lorafleet.nats._bus import encode
from lorafleet.nats._micro import Route
from lorafleet.states import FINAL, IllegalTransitionError, is_final
from lorafleet_schemas.messages import (
    AdapterListRequest,
    ArtifactKind,
    ArtifactStoredRequest,
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
    StatusReport,
    TransitionReply,
    TransitionRequest,
)
from lorafleet_services.recorder import job_writes, store
from lorafleet_services.recorder.db import Sessions, database_down
from lorafleet_services.recorder.fold import Move
from lorafleet_services.recorder.job_writes import JobChange, StatusResult
from lorafleet_services.recorder.retention import RetentionApi
from lorafleet_services.recorder.serving_api import ServingApi


class Datasets(Protocol):
    """The datasets object-store bucket, as the recorder uses it."""

    async def put(self, name: str, content: bytes) -> None:
        """Store `content` under `name` (when that object exists, only touched:
        lorafleet.objects.touch_object)."""

    async def touch(self, name: str) -> bool:
        """Touch the stored object `name` before a job names it (retention's
        rule, lorafleet.objects); False when there is none."""

    async def get(self, name: str) -> bytes | None:
        """The object's bytes, or None when there is no such object."""


Publish = Callable[[str, bytes], Awaitable[None]]

#: The largest number an integer column holds (32 bits, on both backends).
MAX_STORED_INT = 2**31 - 1


def nul_at(value: Any, path: str = "$") -> str | None:
    """The JSON path of the first text in `value` (a decoded message) that
    holds a NUL character, or None. PostgreSQL cannot store one in a text
    column, or take one as a query parameter."""
    if isinstance(value, str):
        return path if "\x00" in value else None
    if isinstance(value, msgspec.Struct):
        # The class attributes, not msgspec.structs.fields: that one inspects
        # the type on every call (0.3 ms a status report).
        items: Sequence[tuple[str, Any]] = [
            (f".{encoded}", getattr(value, name))
            for name, encoded in zip(
                value.__struct_fields__, value.__struct_encode_fields__, strict=True
            )
        ]
    elif isinstance(value, dict):
        items = [(f".{k}", k) for k in value] + [(f".{k}", v) for k, v in value.items()]
    elif isinstance(value, list | tuple):
        items = [(f"[{i}]", v) for i, v in enumerate(value)]
    else:
        return None
    for step, item in items:
        found = nul_at(item, path + step)
        if found is not None:
            return found
    return None


def refusing_nul(fn: Callable[[Any], Awaitable[Any]]) -> Callable[[Any], Awaitable[Any]]:
    """`fn`, refusing a request with a NUL in any text as a bad request naming
    where (the same on SQLite, so both backends answer alike)."""

    async def checked(request: Any) -> Any:
        path = nul_at(request)
        if path is not None:
            raise BadRequestError(f"{path} holds a NUL character (U+0000): remove it", path)
        return await fn(request)

    return checked


#: PostgreSQL's disk_full: a write found no room (reads go on).
DISK_FULL_SQLSTATE = "53100"


def unavailable_while_database_down(
    fn: Callable[[Any], Awaitable[Any]],
) -> Callable[[Any], Awaitable[Any]]:
    """`fn`, answering `unavailable` (a retry) while the database does not
    answer (down, restarting, starting up): an `internal` error said "it is
    logged" and the gateway gave clients a 500 that they do not retry
    (nemesis seed 12, PostgreSQL restarted)."""

    async def guarded(request: Any) -> Any:
        try:
            return await fn(request)
        except sqlalchemy.exc.OperationalError as e:
            if not database_down(e):
                raise
            first = str(e.orig).strip().splitlines()[0] if e.orig is not None else str(e)
            if getattr(e.orig, "sqlstate", None) == DISK_FULL_SQLSTATE:
                raise UnavailableError(
                    f"the recorder's database is out of disk space ({first}): free space "
                    "under its data directory; retry once it has"
                ) from None
            raise UnavailableError(
                f"the recorder's database does not answer ({first}): it is down or "
                "restarting; retry in a few seconds"
            ) from None

    return guarded


class RecorderApi:
    """Everything the recorder answers and applies, without a bus of its own."""

    def __init__(self, sm: Sessions, names: Names, datasets: Datasets, publish: Publish) -> None:
        self.sm = sm
        self.names = names
        self.datasets = datasets
        self.publish = publish
        self.logger = log.get()
        #: The serving records' list and reports (serving_api.py).
        self.serving = ServingApi(sm, self._send_event)
        #: Deleting jobs, forgetting removed artifacts (retention.py).
        self.retention = RetentionApi(sm, self._publish)

    def routes(self) -> list[Route]:
        n = self.names
        handlers: list[tuple[str, type, Callable[[Any], Awaitable[Any]]]] = [
            (n.models_add, ModelSpec, self.models_add),
            (n.models_list, ModelListRequest, self.models_list),
            (n.jobs_submit, JobSpec, self.jobs_submit),
            (n.jobs_get, JobGetRequest, self.jobs_get),
            (n.jobs_list, JobListRequest, self.jobs_list),
            (n.jobs_curve, JobCurveRequest, self.jobs_curve),
            (n.jobs_estimate, JobEstimateRequest, self.jobs_estimate),
            (n.jobs_resume, JobResumeRequest, self.jobs_resume),
            (n.jobs_delete, JobDeleteRequest, self.retention.jobs_delete),
            (n.adapters_list, AdapterListRequest, self.serving.adapters_list),
            (n.store_transition, TransitionRequest, self.transition),
            (n.store_artifact, ArtifactStoredRequest, self.artifact),
        ]
        return [
            Route(subject, typ, unavailable_while_database_down(refusing_nul(fn)))
            for subject, typ, fn in handlers
        ]

    # --- the catalog ---

    async def models_add(self, spec: ModelSpec) -> ModelRecord:
        if spec.hf_repo is None and spec.local_dir is None:
            raise BadRequestError(
                "give the model's weights: hf_repo (a Hugging Face repo) or local_dir "
                "(a directory on the nodes)",
                "$.hf_repo",
            )
        if spec.hf_repo is not None and spec.local_dir is not None:
            raise BadRequestError("give hf_repo or local_dir, not both", "$.local_dir")
        for name in ("hf_repo", "local_dir"):
            if getattr(spec, name) == "":
                raise BadRequestError(f"{name} is empty", f"$.{name}")
        try:
            record = await store.add_model(self.sm, spec)
        except store.ModelExistsError:
            raise ConflictError(
                f"the catalog has a model named {spec.name} already: choose another name",
                "$.name",
            ) from None
        self.logger.info(Event.MODEL_ADDED, model=record.name, engine=record.engine.value)
        return record

    async def models_list(self, _req: ModelListRequest) -> ModelList:
        return ModelList(models=await store.list_models(self.sm))

    # --- jobs ---

    async def _model(self, name: str) -> ModelRecord:
        model = await store.get_model(self.sm, name)
        if model is None:
            known = [m.name for m in await store.list_models(self.sm)]
            listing = ", ".join(known) if known else "none yet (add one with models.add)"
            raise NotFoundError(
                f"no model {name} in the catalog; known models: {listing}", "$.model"
            )
        return model

    async def jobs_estimate(self, req: JobEstimateRequest) -> JobEstimate:
        return job_estimate(await self._model(req.model), req)

    async def jobs_submit(self, spec: JobSpec) -> JobRecord:
        model = await self._model(spec.model)
        spec = memory_checked(model, spec)
        if spec.resume_from is not None:
            await self._check_resume_from(spec)
        if (spec.data is None) == (spec.dataset is None):
            raise BadRequestError(
                'give the training data either inline ("data": NDJSON text) or by name '
                '("dataset": an object in the datasets bucket), exactly one of the two',
                "$.data",
            )
        if spec.eval_data is not None and spec.eval_dataset is not None:
            raise BadRequestError(
                'give the evaluation set either inline ("eval_data": NDJSON text) or by name '
                '("eval_dataset": an object in the datasets bucket), not both',
                "$.eval_data",
            )
        # Both sets are checked before either is stored: a refused job stores nothing.
        kind = spec.params.method
        train = await self._checked_data(spec.data, spec.dataset, "data", "dataset", kind)
        eval_set = None
        if spec.eval_data is not None or spec.eval_dataset is not None:
            eval_set = await self._checked_data(
                spec.eval_data, spec.eval_dataset, "eval_data", "eval_dataset", kind
            )
        for inline, stored in ((spec.data, train), (spec.eval_data, eval_set)):
            if inline is not None and stored is not None:
                # Stored before the job exists, so a job never names missing data.
                await self.datasets.put(stored.name, inline.encode())
        job = await store.create_job(
            self.sm, spec, model, train.name, train.sha256, train.records, eval_set=eval_set
        )
        metrics.JOBS_SUBMITTED.inc()
        self.logger.info(
            Event.JOB_QUEUED,
            job_id=job.id,
            node=job.node,
            state=job.state.value,
            model=job.model,
            records=job.records,
            sha256=job.dataset_sha256,
        )
        await self._publish(JobChange(job, "state", []))
        return job

    async def _check_resume_from(self, spec: JobSpec) -> None:
        """A job that starts from another's work names an ended job of the same
        model that stored a checkpoint or an adapter."""
        other = spec.resume_from
        found = await store.resume_source(self.sm, other or "")
        if found is None:
            raise BadRequestError(
                f"resume_from names job {other}, which does not exist: give the id of a job "
                "that stored a checkpoint or an adapter (lorafleet jobs list)",
                "$.resume_from",
            )
        job, ref = found
        if ref is None:
            raise BadRequestError(
                f"job {other} (resume_from) stored neither a checkpoint nor an adapter, so "
                "there is nothing to start from: name a job that trained for a while, or "
                "drop resume_from",
                "$.resume_from",
            )
        if job.model != spec.model:
            raise BadRequestError(
                f"job {other} (resume_from) trained model {job.model}, not {spec.model}: "
                "an adapter only fits the model it was trained on",
                "$.resume_from",
            )
        if not is_final(job.state):
            # Its checkpoint is replaced as it trains, under the one object name:
            # what a new job fetched could differ from what it was sent.
            raise BadRequestError(
                f"job {other} (resume_from) is still {job.state.value}: start from it once it "
                f"has ended (wait for it, or `lorafleet cancel {other}`)",
                "$.resume_from",
            )

    async def jobs_resume(self, req: JobResumeRequest) -> JobRecord:
        try:
            job, move = await job_writes.resume_job(self.sm, req.id, req.attempts, req.reason)
        except store.NoSuchJobError:
            raise NotFoundError(f"no job {req.id}: list jobs with jobs.list", "$.id") from None
        except store.NotResumableError as e:
            raise ConflictError(str(e), "$.id") from None
        change = JobChange(job, "state", [move])
        log_moves(self.logger, change)
        await self._publish(change)
        return job

    async def _checked_data(
        self,
        inline: str | None,
        named: str | None,
        inline_field: str,
        named_field: str,
        kind: str,
    ) -> store.StoredData:
        """Records given inline or by name, checked by the records' rule
        (lorafleet.training_data), each of `kind` (the job's method); nothing
        stored yet. The errors name the field: the training data's and the
        evaluation set's are alike."""
        if inline is not None:
            content = inline.encode()
            records, sha = _check_data(content, inline_field, kind)
            return store.StoredData(dataset_object_name(sha), sha, records)
        name = named or ""
        # Touched before it is read and the job row written: a retention
        # sweep that found it unneeded before this cannot remove it now.
        stored = await self.datasets.get(name) if await self.datasets.touch(name) else None
        if stored is None:
            raise NotFoundError(
                f"no object {name} in bucket {self.names.datasets_bucket} ({named_field}): "
                f"upload it with `nats object put {self.names.datasets_bucket} FILE` or send "
                f'the records inline ("{inline_field}")',
                f"$.{named_field}",
            )
        records, sha = _check_data(stored, named_field, kind)
        _check_named_by_content(name, sha, named_field)
        return store.StoredData(name, sha, records)

    async def jobs_get(self, req: JobGetRequest) -> JobRecord:
        job = await store.get_job(self.sm, req.id)
        if job is None:
            raise NotFoundError(f"no job {req.id}: list jobs with jobs.list", "$.id")
        return job

    async def jobs_list(self, req: JobListRequest) -> JobList:
        jobs = await store.list_jobs(
            self.sm,
            state=req.state,
            states=req.states,
            node=req.node,
            model=req.model,
            limit=req.limit,
            oldest_first=req.oldest_first,
            ids=req.ids,
            after=req.after,
            placed=req.placed,
        )
        return JobList(jobs=jobs)

    async def jobs_curve(self, req: JobCurveRequest) -> JobCurve:
        try:
            return await store.curve(self.sm, req.id)
        except store.NoSuchJobError:
            raise NotFoundError(f"no job {req.id}: list jobs with jobs.list", "$.id") from None

    # --- internal ---

    async def transition(self, req: TransitionRequest) -> TransitionReply:
        try:
            applied, job = await store.transition(
                self.sm, req.id, req.from_state, req.to_state, req.message, req.node,
                moved=req.moved,
            )  # fmt: skip
        except IllegalTransitionError as e:
            raise ConflictError(str(e), "$.to_state") from None
        except store.NoSuchJobError:
            raise NotFoundError(f"no job {req.id}", "$.id") from None
        if applied and req.from_state is req.to_state:
            # A queued job's new message (what it waits for): no move to log.
            await self._publish(JobChange(job, "progress", []))
        elif applied:
            change = JobChange(job, "state", [Move(req.from_state, req.to_state, req.message)])
            log_moves(self.logger, change)
            await self._publish(change)
        else:
            self.logger.info(
                Event.TRANSITION_REFUSED,
                job_id=req.id,
                node=req.node,
                state=job.state.value,
                message=f"asked {req.from_state.value} -> {req.to_state.value}; "
                f"the job is {job.state.value} on {job.node}",
            )
        return TransitionReply(applied=applied, job=job)

    async def artifact(self, req: ArtifactStoredRequest) -> JobRecord:
        if req.removed:
            return await self.retention.forget_artifact(req)
        try:
            job, change = await job_writes.record_artifact(
                self.sm,
                req.id,
                req.kind,
                req.size,
                req.sha256,
                step=req.step,
                attempt=req.attempt,
                object_name=req.object,
            )
        except store.NoSuchJobError:
            raise NotFoundError(f"no job {req.id}", "$.id") from None
        except (store.ArtifactKindError, store.CheckpointFieldsError) as e:
            raise BadRequestError(str(e), "$.kind") from None
        if change is not None and req.kind is ArtifactKind.CHECKPOINT:
            self.logger.info(Event.JOB_CHECKPOINT, job_id=job.id, node=job.node, step=req.step)
        if change is not None:
            log_moves(self.logger, change)
            await self._publish(change)
        return job

    # --- status reports (the consumer calls these) ---

    async def apply_status(self, reports: Sequence[StatusReport]) -> StatusResult:
        """Apply a batch in one transaction; log refusals. Publish with `after_status`."""
        result = await job_writes.apply_status(self.sm, reports)
        metrics.reports_committed(reports, result.applied, len(result.refused))
        log.reports_refused(self.logger, result.refused)
        return result

    async def after_status(self, result: StatusResult) -> None:
        """Log and publish each change of a committed batch."""
        for change in result.changes:
            job = change.job
            self.logger.info(
                Event.JOB_PROGRESS,
                job_id=job.id,
                node=job.node,
                state=job.state.value,
                step=job.step,
                steps=job.steps,
                loss=job.loss,
                peak_mib=job.peak_mib,
            )
            log_moves(self.logger, change)
            await self._publish(change)

    async def _publish(self, change: JobChange) -> None:
        # Best effort: the change is committed; a watcher that missed the
        # event reads the job. A failed publish must not fail the request.
        event = JobEvent(
            kind=change.kind,
            job=change.job,
            tokens_per_s=change.tokens_per_s,
            eta_s=change.eta_s,
        )
        await self._send_event(change.job.id, event)

    async def _send_event(self, job_id: str, event: JobEvent) -> None:
        try:
            await self.publish(self.names.job_events(job_id), encode(event))
        except Exception as e:
            self.logger.warning(Event.NATS_ERROR, job_id=job_id, error=repr(e))


def _check_data(content: bytes, field: str, kind: str) -> tuple[int, str]:
    """(records, sha256) of `content`, or a bad request naming `field`."""
    try:
        return training_data.validate(content, kind)
    except training_data.DataError as e:
        label = "the training data" if field in ("data", "dataset") else field
        raise BadRequestError(f"{label}: {e}", f"$.{field}") from None


def _check_named_by_content(dataset: str, sha: str, field: str = "dataset") -> None:
    """A `sha256/<hex>` dataset must hold the data of that sha256: a client may
    put into the datasets bucket, so one could have overwritten it."""
    prefix = dataset_object_name("")
    if dataset.startswith(prefix) and dataset != dataset_object_name(sha):
        raise ConflictError(
            f"the object {dataset} holds data whose sha256 is {sha}, not the one its name "
            "gives: it was overwritten; have an operator delete it (`nats object rm "
            "<datasets bucket> <name>`) and submit again",
            f"$.{field}",
        )


# --- the memory estimate ---


def job_estimate(model: ModelRecord, req: JobEstimateRequest) -> JobEstimate:
    """The estimate for a job of `model`, and whether req.gpu_memory_mib fits it."""
    if model.architecture is None:
        return JobEstimate(
            model=model.name,
            reason=(
                f"model {model.name} was added without its architecture (config.json's "
                "sizes), so there is no estimate: add it again from a directory or the "
                "Hugging Face cache that holds config.json, or give gpu_memory_mib yourself"
            ),
        )
    try:
        est = estimate.estimate_memory(
            model.architecture, req.params, budget_mib=req.gpu_memory_mib
        )
    except estimate.EstimateError as e:
        return JobEstimate(model=model.name, reason=str(e))
    fits = req.gpu_memory_mib is None or req.gpu_memory_mib >= est.total_mib
    reason = "" if fits else estimate.shortfall_message(est, req.gpu_memory_mib or 0)
    return JobEstimate(model=model.name, estimate=est, reason=reason, fits=fits)


def memory_checked(model: ModelRecord, spec: JobSpec) -> JobSpec:
    """`spec` with its gpu_memory_mib: the estimate plus its margin when none is
    given; BadRequestError when the given one is below the estimate (unless
    spec.ignore_estimate) or none is given and there is no estimate."""
    answer = job_estimate(
        model,
        JobEstimateRequest(
            model=spec.model, params=spec.params, gpu_memory_mib=spec.gpu_memory_mib
        ),
    )
    if spec.gpu_memory_mib is None:
        if answer.estimate is None:
            raise BadRequestError(f"give gpu_memory_mib: {answer.reason}", "$.gpu_memory_mib")
        spec = msgspec.structs.replace(spec, gpu_memory_mib=answer.estimate.recommended_mib)
    elif not answer.fits and not spec.ignore_estimate:
        raise BadRequestError(answer.reason, "$.gpu_memory_mib")
    if spec.gpu_memory_mib is not None and spec.gpu_memory_mib > MAX_STORED_INT:
        raise BadRequestError(
            f"gpu_memory_mib {spec.gpu_memory_mib} is more than the recorder stores "
            f"({MAX_STORED_INT} MiB at most)",
            "$.gpu_memory_mib",
        )
    return spec


def log_moves(logger: Any, change: JobChange) -> None:
    """Each state move of `change` as log lines: the state, a requeue, an end."""
    job = change.job
    for move in change.moves:
        logger.info(
            Event.JOB_STATE,
            job_id=job.id,
            node=job.node,
            state=move.to_state.value,
            message=move.message,
        )
        if move.to_state is JobState.QUEUED:
            logger.info(
                Event.JOB_REQUEUED,
                job_id=job.id,
                node=job.node,
                state=move.from_state.value,
                attempt=job.attempt,
                message=move.message,
            )
        if move.to_state in FINAL:
            metrics.JOBS_FINISHED.labels(move.to_state.value).inc()
            fields: dict[str, Any] = {
                "job_id": job.id,
                "node": job.node,
                "state": move.to_state.value,
                "message": move.message,
                "step": job.step,
                "steps": job.steps,
                "loss": job.loss,
                "peak_mib": job.peak_mib,
            }
            logger.info(Event.JOB_FINISHED, **fields)
