"""Succeeded means usable: a chat with a fine-tuned model whose adapter is
on its way to an engine waits for it (bounded) instead of a 404.

A job is `succeeded` once its artifacts are stored; the agent loads its
adapter a moment later (seconds on a GPU, tens of seconds with the PEFT
probe on a busy CPU). An OpenAI client chats as soon as it reads
`succeeded`, so a completion for a model with no location waits while
`on_its_way` says the adapter is coming: a serving record `loading`, or
none yet for a job that finished less than `REPORT_GRACE_S` ago while an
engine serves its base (the agent reports `loading` once it has its
engine lock). It stops at the first location (any replica), at a record
that says it will not come (refused, failed, ...: the 404 then says why),
or after `GatewayConfig.adapter_load_wait_s` (the 404 says to retry).

Why not keep the job `running` until a replica serves it: the job's state
is training's, shared by the CLI, the scheduler and the recorder; with a
model placed on several replicas "served" has no one moment, and a node
that comes later loads it long after the job ended. The wait is the
gateway's alone, and the same wait covers a replica being placed again.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable

from lorafleet.polling import poll_until
from lorafleet_schemas.messages import JobRecord, JobState, ServingRecord, ServingState
from lorafleet_services.gateway.context import GatewayContext

#: Seconds after a job's end during which no serving record yet still means
#: "coming": the agent stages the adapter and takes its engine lock first.
REPORT_GRACE_S = 30.0
#: Seconds between two looks at where the model is while it is loading.
LOAD_POLL_S = 0.25


def on_its_way(
    job: JobRecord, records: Iterable[ServingRecord], base_served: bool, now: dt.datetime
) -> bool:
    """Whether `job`'s adapter is being loaded (or about to be) on some engine.

    records: the job's serving records, any state. base_served: an engine
    serves the job's base somewhere (else no record will ever come)."""
    if job.state is not JobState.DONE or job.serve is False:
        return False
    newest_first = sorted(records, key=lambda r: r.updated_at, reverse=True)
    if any(r.state is ServingState.LOADING for r in newest_first):
        return True
    if newest_first or not base_served:
        return False
    ended = job.finished_at or job.updated_at
    return (now - ended).total_seconds() < REPORT_GRACE_S


async def wait_for_adapter(ctx: GatewayContext, model: str, base: str, job_id: str) -> None:
    """Return once `model` has a location, or once it will not have one soon
    (the caller's lookup then answers the 404 that says why)."""

    async def served_or_not_coming() -> bool:
        if await ctx.locator.where(model):
            return True
        job = await ctx.client.get(job_id)
        records = await ctx.client.adapters([job_id])
        base_served = bool(await ctx.locator.where(base))
        return not on_its_way(job, records, base_served, dt.datetime.now(dt.UTC))

    await poll_until(
        served_or_not_coming, timeout_s=ctx.config.adapter_load_wait_s, interval_s=LOAD_POLL_S
    )
