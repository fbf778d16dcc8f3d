"""A project's own: the one ownership rule, and the project's quotas.

The rule: a file, a job and the job's fine-tuned model belong to the
project whose key made them (api_keys.py: keys of one project share them),
and are found only under that project's name in the gateway's bucket
(state.py: `files.<project>.*`, `jobs.<project>.*`). Every route looks them
up with the caller's project (`owner_of`), so another project's id is
"not found" — OpenAI's 404, as for an id that never was, never a 403 that
would say it exists. A fine-tuned name is its job's: `usable_model` asks
the same question before any engine is, and of an adapter's served name
too (what a configured engine lists it as). Jobs submitted around the gateway
(the CLI, the NATS API) belong to no project: no key chats with their
models. The bases (catalog models, an engine's own) are every project's.

Quotas (GatewayConfig; None: none): jobs in flight (queued or on a node)
and bytes uploaded (the sizes of the project's files now kept; deleting a
file frees its bytes), per project. One more is a 429 that names the quota,
its limit and the setting. Checked twice: before the work (the common
refusal, nothing made), and after the file's or job's entry is put, over
the entries put up to it in the bucket's order (a revision, the same on
every gateway replica): requests at once each pass the first check, and
the ones the bucket ordered past the quota are undone and refused there.
"""

from __future__ import annotations

from lorafleet._recorder_client import jobs_among
from lorafleet.errors import ConflictError
from lorafleet.fleet_serving import served_name_job
from lorafleet.states import ACTIVE
from lorafleet_schemas.messages import JobListRequest
from lorafleet_services.gateway.adapter_wait import wait_for_adapter
from lorafleet_services.gateway.context import GatewayContext
from lorafleet_services.gateway.http_errors import GatewayHttpError, not_found
from lorafleet_services.gateway.job_mapping import fine_tuned_parts


def model_not_found(model: str) -> GatewayHttpError:
    """OpenAI's answer for a model that is not there, or not the caller's."""
    return not_found(
        f"the model {model!r} does not exist or is not this project's: GET /v1/models "
        "lists the models your key may use",
        "model",
        code="model_not_found",
    )


async def usable_model(ctx: GatewayContext, project: str, model: str) -> None:
    """Check that `project` may use `model` (a 404 when it is another's
    fine-tuned model), and wait while its adapter is being loaded (bounded:
    adapter_wait.py)."""
    tuned = fine_tuned_parts(model)
    if tuned is None:
        job = served_name_job(model)
        if job is not None and await ctx.state.job(project, job) is None:
            raise model_not_found(model)
        return
    base, job_id = tuned
    fields = await ctx.state.job(project, job_id)
    if fields is None or fields.model != base:
        raise model_not_found(model)
    await wait_for_adapter(ctx, model, base, job_id)


#: What a project over each quota can do, besides raising its setting.
_ADVICE = {
    "jobs in flight": "cancel one, or wait for one to end",
    "bytes uploaded": "delete files it no longer needs (DELETE /v1/files/{id})",
}


def quota_exceeded(what: str, used: int, more: int, limit: int | None, setting: str) -> str | None:
    """The 429's message when `used` + `more` of `what` passes `limit`; None when it fits."""
    if limit is None or used + more <= limit:
        return None
    return (
        f"this project's quota of {what} is {limit} and it has {used}"
        f"{f' (this request adds {more})' if more > 1 else ''}: "
        f"{_ADVICE.get(what, 'wait')}, or raise {setting}"
    )


def over_quota(message: str) -> GatewayHttpError:
    """The 429 of a quota, saying `message` (quota_exceeded's)."""
    return GatewayHttpError(429, message, code="quota_exceeded")


def _refuse_over(what: str, used: int, more: int, limit: int | None, setting: str) -> None:
    message = quota_exceeded(what, used, more, limit, setting)
    if message is not None:
        raise over_quota(message)


JOBS_SETTING = "LORAFLEET_GATEWAY_MAX_JOBS_IN_FLIGHT_PER_PROJECT"
BYTES_SETTING = "LORAFLEET_GATEWAY_MAX_UPLOAD_BYTES_PER_PROJECT"


async def _in_flight(ctx: GatewayContext, project: str, upto: int | None = None) -> int:
    """The project's jobs in flight (those whose entries were put up to `upto`)."""
    ids = [f.job_id for f in await ctx.state.jobs(project, upto)]
    active = JobListRequest(states=sorted(ACTIVE))
    return len(await jobs_among(ctx.client.jobs, ids, active))


async def check_job_quota(ctx: GatewayContext, project: str) -> None:
    """A 429 when the project has its quota of jobs in flight already."""
    limit = ctx.config.max_jobs_in_flight_per_project
    if limit is not None:
        _refuse_over("jobs in flight", await _in_flight(ctx, project), 1, limit, JOBS_SETTING)


async def job_over_quota(ctx: GatewayContext, project: str, revision: int) -> str | None:
    """After a job's entry was put at `revision`: the 429's message when the
    project's jobs in flight put up to it (itself included) pass the quota."""
    limit = ctx.config.max_jobs_in_flight_per_project
    if limit is None:
        return None
    used = await _in_flight(ctx, project, revision) - 1
    return quota_exceeded("jobs in flight", used, 1, limit, JOBS_SETTING)


#: Cancels tried on a job refused after the fact, each lost to the job
#: changing state under it (the recorder's own CAS tries are spent by then).
UNDO_CANCEL_ATTEMPTS = 3


async def undo_refused_job(ctx: GatewayContext, project: str, job_id: str, over: str) -> None:
    """Cancel and forget a job `job_over_quota` refused, the project's entry
    last: a step that fails leaves the job in the project's list (cancelled,
    or at worst still queued, for the caller to see and cancel), never
    running outside any project."""
    for attempt in range(1, UNDO_CANCEL_ATTEMPTS + 1):
        try:
            await ctx.client.cancel(job_id, reason=f"refused: {over}")
            break
        except ConflictError:
            if attempt == UNDO_CANCEL_ATTEMPTS:
                raise
    await ctx.client.delete(job_id, reason="refused over its project's quota")
    await ctx.state.delete_job(project, job_id)


async def check_upload_quota(ctx: GatewayContext, project: str, incoming: int) -> None:
    """A 429 when `incoming` more bytes would pass the project's upload quota."""
    limit = ctx.config.max_upload_bytes_per_project
    if limit is not None:
        used = sum(f.bytes for f in await ctx.state.files(project))
        _refuse_over("bytes uploaded", used, incoming, limit, BYTES_SETTING)


async def upload_over_quota(
    ctx: GatewayContext, project: str, revision: int, size: int
) -> str | None:
    """After a file's entry (of `size` bytes) was put at `revision`: the 429's
    message when the project's files put up to it pass the quota."""
    limit = ctx.config.max_upload_bytes_per_project
    if limit is None:
        return None
    used = sum(f.bytes for f in await ctx.state.files(project, revision)) - size
    return quota_exceeded("bytes uploaded", used, size, limit, BYTES_SETTING)
