"""`/v1/files` and `/v1/fine_tuning/jobs`: OpenAI's fine-tuning API over lorafleet.

Each handler reads the request, asks lorafleet (`lorafleet.client.Client`)
and the gateway's state, and answers in OpenAI's shape; the mapping is
job_mapping's, the errors http_errors'. A file is checked with the
training records' rules while it is put into the datasets bucket, and is
named there (by its sha256) only once all of it passed (uploads.py; the
error names the line). Two uploads of the same bytes share one object;
deleting a file object leaves the data, which jobs may still name: the
recorder's retention removes it once nothing names it (lorafleet.retention).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from lorafleet import log
from lorafleet.errors import NotFoundError
from lorafleet.objects import StagedObject
from lorafleet.states import FINAL
from lorafleet_schemas.messages import JobRecord, JobState
from lorafleet_services.gateway import job_mapping as jm
from lorafleet_services.gateway import tenancy
from lorafleet_services.gateway.context import GatewayContext, json_response, owner_of
from lorafleet_services.gateway.http_errors import bad_request, conflict, not_found
from lorafleet_services.gateway.openai_shapes import (
    FileDeleted,
    FileObject,
    JobCreate,
)
from lorafleet_services.gateway.state import FileRecord, JobFields
from lorafleet_services.gateway.uploads import FINE_TUNE, store_upload


def _file_object(f: FileRecord) -> FileObject:
    return FileObject(
        id=f.id, bytes=f.bytes, created_at=jm.unix(f.created_at) or 0,
        filename=f.filename, purpose=f.purpose,
    )  # fmt: skip


def _limit(request: Request, default: int = jm.DEFAULT_PAGE) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return default
    if not raw.isdigit():
        raise bad_request(f"limit={raw!r}: give a whole number from 1 to {jm.MAX_PAGE}", "limit")
    return int(raw)


async def create_file(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    content_type = request.headers.get("content-type", "")
    length = request.headers.get("content-length", "")
    await tenancy.check_upload_quota(ctx, owner, int(length) if length.isdigit() else 1)
    async with StagedObject(ctx.client.js, ctx.client.names.datasets_bucket) as staged:
        stored = await store_upload(request.stream(), content_type, staged, ctx.checker)
    # Exact now (a body without a length passed the first check): over, no
    # file entry is made, and the data is what a delete would leave.
    await tenancy.check_upload_quota(ctx, owner, stored.size)
    record = FileRecord(
        id=f"file-{uuid.uuid4().hex[:24]}", filename=stored.filename, bytes=stored.size,
        created_at=dt.datetime.now(dt.UTC), purpose=stored.purpose, dataset=stored.dataset,
        records=stored.records,
    )  # fmt: skip
    revision = await ctx.state.put_file(owner, record)
    over = await tenancy.upload_over_quota(ctx, owner, revision, record.bytes)
    if over is not None:  # requests at once: this one came after the quota
        await ctx.state.delete_file(owner, record.id)
        raise tenancy.over_quota(over)
    log.get().info(
        log.Event.GATEWAY_FILE_STORED,
        file_id=record.id, bytes=record.bytes, records=record.records, client=owner,
    )  # fmt: skip
    return json_response(_file_object(record))


async def _file_or_404(request: Request, param: str = "file_id") -> FileRecord:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    file_id = request.path_params["file_id"]
    found = await ctx.state.file(owner, file_id)
    if found is None:
        raise not_found(f"no file {file_id!r}: upload one with POST /v1/files", param)
    return found


async def list_files(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    files = sorted(await ctx.state.files(owner), key=lambda f: f.created_at, reverse=True)
    if request.query_params.get("order") == "asc":
        files.reverse()
    purpose = request.query_params.get("purpose")
    if purpose:
        files = [f for f in files if f.purpose == purpose]
    page = jm.paginate(
        [_file_object(f) for f in files],
        lambda f: f.id,
        request.query_params.get("after"),
        _limit(request, default=jm.MAX_PAGE),
    )
    return json_response(page)


async def retrieve_file(request: Request) -> Response:
    return json_response(_file_object(await _file_or_404(request)))


async def file_content(request: Request) -> Response:
    ctx = GatewayContext.of(request)
    found = await _file_or_404(request)
    data = await ctx.read_dataset(found.dataset)
    return Response(data, media_type="application/octet-stream")


async def delete_file(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    found = await _file_or_404(request)
    await ctx.state.delete_file(owner, found.id)
    log.get().info(log.Event.GATEWAY_FILE_DELETED, file_id=found.id, client=owner)
    return json_response(FileDeleted(id=found.id, deleted=True))


# --- jobs -----------------------------------------------------------------------


async def _decode_json(request: Request, typ: type[Any]) -> Any:
    try:
        return msgspec.json.decode(await request.body(), type=typ)
    except msgspec.ValidationError as e:
        raise bad_request(f"the request body: {e}") from None
    except msgspec.DecodeError as e:
        raise bad_request(f"the request body is not JSON: {e}") from None


async def _fine_tune_file(ctx: GatewayContext, owner: str, file_id: str, param: str) -> FileRecord:
    """The caller's file `file_id` for a job's `param` (training_file,
    validation_file): OpenAI's 404 when there is none, 400 when it was not
    uploaded for fine-tuning."""
    file = await ctx.state.file(owner, file_id)
    if file is None:
        raise not_found(
            f"{param}: no file {file_id!r}: upload the data with "
            f'POST /v1/files (purpose="{FINE_TUNE}") and pass its id',
            param,
        )
    if file.purpose != FINE_TUNE:
        raise bad_request(
            f"{param}: the file {file_id!r} has purpose {file.purpose!r}; a job's data "
            f'must be uploaded with purpose="{FINE_TUNE}"',
            param,
        )
    return file


async def _parent(ctx: GatewayContext, owner: str, model: str) -> tuple[str, str] | None:
    """(base, job id) of the fine-tuned model `model` a job starts from (None
    for a base): only the caller's own, and only once its job succeeded.
    The one place a job's start is checked for its owner."""
    parts = jm.fine_tuned_parts(model)
    if parts is None:
        return None
    fields = await ctx.state.job(owner, parts[1])
    if fields is None:
        raise not_found(
            f"model: no fine-tuned model {model!r} of yours: start from one of your "
            "own (GET /v1/fine_tuning/jobs lists them) or from a base model",
            "model",
        )
    status = jm.status_of(await ctx.client.get(parts[1]), fields)
    if status != "succeeded":
        raise bad_request(
            f"model: the job of {model!r} is {status}: a job starts from a fine-tuned "
            "model once its job has succeeded",
            "model",
        )
    return fields.model, parts[1]


async def create_job(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    create: JobCreate = await _decode_json(request, JobCreate)
    hp = jm.requested_hyperparameters(create)  # a method not taken: 400 before any lookup
    await tenancy.check_job_quota(ctx, owner)
    file = await _fine_tune_file(ctx, owner, create.training_file, "training_file")
    validation = None
    if create.validation_file is not None:
        validation = await _fine_tune_file(ctx, owner, create.validation_file, "validation_file")
    parent = await _parent(ctx, owner, create.model)
    spec = jm.job_spec(create, file, jm.trainer_params(create, hp), validation, parent)
    job = await ctx.client.submit(spec)
    fields = jm.job_fields(create, job, dt.datetime.now(dt.UTC))
    over = await tenancy.job_over_quota(ctx, owner, await ctx.state.put_job(owner, fields))
    if over is not None:  # requests at once: this one came after the quota
        await tenancy.undo_refused_job(ctx, owner, job.id, over)
        raise tenancy.over_quota(over)
    return json_response(jm.to_openai(job, fields, owner, dt.datetime.now(dt.UTC)))


async def _job(request: Request) -> tuple[JobRecord, JobFields]:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    openai_id = request.path_params["job_id"]
    fields = await ctx.state.job(owner, jm.lorafleet_job_id(openai_id))
    if fields is None:
        raise not_found(
            f"no fine-tuning job {openai_id!r}: list yours with GET /v1/fine_tuning/jobs",
            "fine_tuning_job_id",
        )
    return await ctx.client.get(fields.job_id), fields


def _job_response(request: Request, job: JobRecord, fields: JobFields) -> Response:
    return json_response(jm.to_openai(job, fields, owner_of(request), dt.datetime.now(dt.UTC)))


async def list_jobs(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    every = sorted(await ctx.state.jobs(owner), key=lambda j: j.created_at, reverse=True)
    page = jm.paginate(
        every,
        lambda j: jm.openai_job_id(j.job_id),
        request.query_params.get("after"),
        _limit(request),
    )
    records = await asyncio.gather(*(_record_or_none(ctx, f.job_id) for f in page.data))
    now = dt.datetime.now(dt.UTC)
    page.data = [
        jm.to_openai(r, f, owner, now)
        for r, f in zip(records, page.data, strict=True)
        if r is not None
    ]
    return json_response(page)


async def _record_or_none(ctx: GatewayContext, job_id: str) -> JobRecord | None:
    """The job's record; None for a job deleted in lorafleet (`lorafleet jobs
    delete`): left out of a listing (its page is one shorter), not a 404 for it."""
    try:
        return await ctx.client.get(job_id)
    except NotFoundError:
        return None


async def retrieve_job(request: Request) -> Response:
    return _job_response(request, *await _job(request))


async def cancel_job(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    job, fields = await _job(request)
    if fields.paused:
        fields.paused = False  # lorafleet cancelled it when it was paused
        await ctx.state.put_job(owner, fields)
        return _job_response(request, job, fields)
    _refuse_ended(job, fields)
    job = await ctx.client.cancel(fields.job_id, reason=f"cancelled through the gateway by {owner}")
    if job.state is not JobState.CANCELLED:
        _refuse_ended(job, fields)  # it ended between the read and the cancel
    return _job_response(request, job, fields)


def _refuse_ended(job: JobRecord, fields: JobFields) -> None:
    """OpenAI's 400 for cancelling a job that has ended (succeeded, failed, cancelled)."""
    if job.state in FINAL:
        status = jm.status_of(job, fields)
        raise bad_request(
            f"the job {jm.openai_job_id(job.id)} has already ended: it is {status}, "
            "and only a queued or running job can be cancelled",
            "fine_tuning_job_id",
        )


async def pause_job(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    job, fields = await _job(request)
    status = jm.status_of(job, fields)
    if status not in ("running", "queued"):
        raise conflict(f"the job is {status}: only a queued or running job can be paused")
    if job.checkpoint is None:
        raise conflict(
            "the job has stored no checkpoint yet, so a pause would lose its training: "
            "wait for one (set lorafleet.checkpoint_every_steps at create), or cancel it"
        )
    fields.paused = True
    await ctx.state.put_job(owner, fields)
    job = await ctx.client.cancel(fields.job_id, reason=f"paused through the gateway by {owner}")
    return _job_response(request, job, fields)


async def resume_job(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    job, fields = await _job(request)
    if not fields.paused:
        raise conflict(f"the job is {jm.status_of(job, fields)}, not paused: nothing to resume")
    job = await ctx.client.resume(fields.job_id, reason=f"resumed through the gateway by {owner}")
    fields.paused = False
    await ctx.state.put_job(owner, fields)
    return _job_response(request, job, fields)


async def job_events(request: Request) -> Response:
    ctx = GatewayContext.of(request)
    job, _ = await _job(request)
    curve = await ctx.client.curve(job.id)
    events = jm.events(job, curve, dt.datetime.now(dt.UTC))
    page = jm.paginate(events, lambda e: e.id, request.query_params.get("after"), _limit(request))
    return json_response(page)


async def job_checkpoints(request: Request) -> Response:
    ctx = GatewayContext.of(request)
    job, fields = await _job(request)
    curve, stored = await asyncio.gather(ctx.client.curve(job.id), ctx.client.artifacts(job.id))
    found = jm.checkpoints(job, fields, curve, stored)
    after = request.query_params.get("after")
    return json_response(jm.paginate(found, lambda c: c.id, after, _limit(request, default=10)))
