"""The gateway's inference routes, beside its training routes (training_routes.py).

Inference (`/v1/chat/completions`, `/v1/completions`) reads only `model`
from the body, asks `ModelLocator` where it is served and forwards the body,
unchanged unless the engine knows the model by another name (a served
adapter's lora_name, an engine's name for its base: `model` is replaced,
the rest kept); a stream's server-sent events are relayed chunk by chunk
as they arrive, never buffered, and a whole answer is passed on whole. An
engine's 404 for a fine-tuned model (its adapter unloaded since the location
was read) drops that location and is the gateway's own 404, with the hint.

Before an engine is asked, `tenancy.usable_model`: another project's
fine-tuned model is a 404, and one whose adapter is being loaded waits for
it (adapter_wait.py).

`GET /v1/models`: the catalog bases, and the caller's project's succeeded
jobs' fine-tuned names, each with the engines serving it; what a configured
engine lists under an adapter's served name (any project's) is left out. A
constant number of requests however many jobs (the jobs and their served
records are asked for all at once).
"""

from __future__ import annotations

import asyncio
import datetime as dt

import httpx2
import msgspec
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from lorafleet import log
from lorafleet._recorder_client import jobs_among, serving_records
from lorafleet.fleet_serving import served_name_job
from lorafleet_schemas.messages import (
    JobListRequest,
    JobState,
    ServingRecord,
    ServingState,
)
from lorafleet_services.gateway import job_mapping as jm
from lorafleet_services.gateway import tenancy
from lorafleet_services.gateway.context import GatewayContext, json_response, owner_of
from lorafleet_services.gateway.fleet_model_location import engine_base_url, unserved_hint
from lorafleet_services.gateway.http_errors import (
    GatewayHttpError,
    bad_request,
    not_found,
)
from lorafleet_services.gateway.model_location import ModelLocation
from lorafleet_services.gateway.openai_shapes import Model, Page

#: Seconds an engine has to start answering a completion (a long one
#: streams; its chunks may come as slowly as the engine makes them).
ENGINE_CONNECT_TIMEOUT_S = 5.0


class _ModelOnly(msgspec.Struct):
    model: str


def with_model(body: bytes, model: str) -> bytes:
    """The request `body` (a JSON object) with its `model` replaced, the rest as sent."""
    fields = msgspec.json.decode(body)
    fields["model"] = model
    return msgspec.json.encode(fields)


async def list_models(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    catalog, served, jobs = await asyncio.gather(
        ctx.client.models(), ctx.locator.served(), ctx.state.jobs(owner)
    )
    ids = [f.job_id for f in jobs]
    done, serving = await asyncio.gather(
        jobs_among(ctx.client.jobs, ids, JobListRequest(state=JobState.DONE)),
        serving_records(ctx.client.list_adapters, ids, ServingState.SERVED),
    )
    fields_of = {f.job_id: f for f in jobs}
    serving_of: dict[str, list[ServingRecord]] = {}
    for record in serving:
        serving_of.setdefault(record.job_id, []).append(record)
    models: dict[str, Model] = {}
    for m in catalog:
        models[m.name] = Model(id=m.name, created=jm.unix(m.created_at) or 0, owned_by="lorafleet")
    for job in sorted(done, key=lambda j: j.created_at):
        fields = fields_of[job.id]
        name = jm.fine_tuned_model_name(fields.model, fields.suffix, job.id)
        models[name] = Model(id=name, created=jm.unix(job.finished_at) or 0, owned_by=owner)
        models[name].served_by = [engine_base_url(r.engine) for r in serving_of.get(job.id, [])]
    now = int(dt.datetime.now(dt.UTC).timestamp())
    for name, locations in served.items():
        if served_name_job(name) is not None and name not in models:
            continue  # an adapter's served name: listed (if the caller's) by its ft name
        model = models.setdefault(name, Model(id=name, created=now, owned_by="engine"))
        model.served_by = list(dict.fromkeys([*model.served_by, *(r.base_url for r in locations)]))
    return json_response(Page(data=list(models.values())))


async def unserved_message(ctx: GatewayContext, model: str) -> str:
    """The 404's message for a model no engine serves now: for a fine-tuned
    name, where its adapter stands (being loaded: retry; refused: the flag)."""
    tuned = jm.fine_tuned_parts(model)
    records = await ctx.client.adapters([tuned[1]]) if tuned else []
    hint = unserved_hint(records) or (
        "GET /v1/models lists what is; a fine-tuned model is served once its job has "
        "succeeded and an engine has loaded its adapter, a second or so later "
        "(`lorafleet serve JOB`, `lorafleet adapters`); a base needs an engine serving it "
        "on a live node (`lorafleet top`) or one in LORAFLEET_GATEWAY_ENGINES"
    )
    return f"the model {model!r} is served by no engine now: {hint}"


class Inference:
    """Forwards completions to the engines that serve the model named."""

    def __init__(self, path: str) -> None:
        self.path = path

    async def handle(self, request: Request) -> Response:
        ctx = GatewayContext.of(request)
        body = await request.body()
        try:
            model = msgspec.json.decode(body, type=_ModelOnly).model
        except msgspec.DecodeError as e:
            raise bad_request(f"the request body has no model: {e}", "model") from None
        await tenancy.usable_model(ctx, owner_of(request), model)
        locations = await ctx.locator.where(model)
        if not locations:
            raise not_found(await unserved_message(ctx, model), "model", code="model_not_found")
        reply, location = await self._to_replicas(ctx, ctx.loads.ranked(locations), model, body)
        if reply.status_code == 404 and jm.fine_tuned_parts(model) is not None:
            # Its adapter was unloaded since the location was read (the TTL):
            # the engine's own 404 would name the served name, not the model.
            ctx.locator.forget(model, location)
            raise not_found(await unserved_message(ctx, model), "model", code="model_not_found")
        return reply

    async def _to_replicas(
        self, ctx: GatewayContext, ranked: list[ModelLocation], model: str, body: bytes
    ) -> tuple[Response, ModelLocation]:
        """The answer of the first replica (least loaded first) that answers at
        all: one that refuses the connection or fails before its first byte
        gives the request to the next; the last one's failure is the 503."""
        for i, location in enumerate(ranked):
            sent = body
            if location.served_name is not None and location.served_name != model:
                sent = with_model(body, location.served_name)
            try:
                return await self._forward(ctx, location, sent), location
            except GatewayHttpError as e:
                if i == len(ranked) - 1:
                    raise
                log.get().warning(log.Event.GATEWAY_RETRIED, engine=location.base_url,
                                  error=e.message)  # fmt: skip
        raise RuntimeError("no location to send to")  # ranked is never empty here

    async def _forward(self, ctx: GatewayContext, location: ModelLocation, body: bytes) -> Response:
        http, loads = ctx.http, ctx.loads
        headers = {"content-type": "application/json"}
        if location.api_key:
            headers["authorization"] = f"Bearer {location.api_key}"
        outgoing = http.build_request(
            "POST", f"{location.base_url}/{self.path}", content=body, headers=headers,
            timeout=httpx2.Timeout(None, connect=ENGINE_CONNECT_TIMEOUT_S),
        )  # fmt: skip
        loads.begin(location.base_url)
        try:
            reply = await http.send(outgoing, stream=True)
        except httpx2.HTTPError as e:
            loads.end(location.base_url)
            raise GatewayHttpError(
                503, f"the engine at {location.base_url} did not answer ({e!r}): retry, or "
                "check the engine", code="engine_unavailable",
            ) from None  # fmt: skip
        media_type = reply.headers.get("content-type", "")
        if not media_type.startswith("text/event-stream"):
            # A whole answer (JSON, an error): read and sent in one piece,
            # which saves chunked encoding's extra writes.
            try:
                body = await reply.aread()
            finally:
                await reply.aclose()
                loads.end(location.base_url)
            return Response(body, status_code=reply.status_code, media_type=media_type or None)

        async def ended() -> None:
            await reply.aclose()
            loads.end(location.base_url)

        return StreamingResponse(
            reply.aiter_raw(),
            status_code=reply.status_code,
            media_type=media_type,
            background=BackgroundTask(ended),
        )
