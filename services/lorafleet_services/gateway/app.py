"""The gateway's HTTP application: routes, authentication, errors, inference.

Starlette (docs/architecture.md says why): every route needs an API key
(`Authorization: Bearer lf-...`, api_keys.py); a key that has
`max_requests_per_key` requests in flight gets a 429. Every error is
OpenAI's shape (http_errors.py), logged once as `gateway.refused`.

Inference (`/v1/chat/completions`, `/v1/completions`) reads only `model`
from the body, asks `ModelRoutes` where it is served and forwards the body,
unchanged unless the engine knows the model by another name (a served
adapter's lora_name, an engine's name for its base: `model` is replaced,
the rest kept); a stream's server-sent events are relayed chunk by chunk
as they arrive, never buffered, and a whole answer is passed on whole. An
engine's 404 for a fine-tuned model (its adapter unloaded since the route
was read) drops that route and is the gateway's own 404, with the hint.

`GET /v1/models`: the catalog bases, and the caller's succeeded jobs'
fine-tuned names, each with the engines serving it; a constant number of
requests however many jobs (the jobs and their served records are asked
for all at once).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import itertools
from collections import Counter
from typing import Any

import httpx2
import msgspec
import nats.errors
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lorafleet import log
from lorafleet.errors import ApiError
from lorafleet_schemas.messages import JobListRequest, JobState, ServingState
from lorafleet_services.gateway import job_mapping as jm
from lorafleet_services.gateway import training_routes as tr
from lorafleet_services.gateway.api_keys import KeyRing
from lorafleet_services.gateway.context import GatewayContext, json_response, owner_of
from lorafleet_services.gateway.fleet_model_location import (
    engine_base_url,
    fine_tuned_parts,
    unserved_hint,
)
from lorafleet_services.gateway.http_errors import (
    GatewayHttpError,
    bad_request,
    from_lorafleet,
    not_found,
    unavailable,
)
from lorafleet_services.gateway.model_location import EngineRoute
from lorafleet_services.gateway.openai_shapes import Model, Page

#: Seconds an engine has to start answering a completion (a long one
#: streams; its chunks may come as slowly as the engine makes them).
ENGINE_CONNECT_TIMEOUT_S = 5.0


#: Most jobs of one caller `GET /v1/models` lists (its newest; the recorder's cap).
LISTED_JOBS_LIMIT = 1000


class _ModelOnly(msgspec.Struct):
    model: str


def with_model(body: bytes, model: str) -> bytes:
    """The request `body` (a JSON object) with its `model` replaced, the rest as sent."""
    fields = msgspec.json.decode(body)
    fields["model"] = model
    return msgspec.json.encode(fields)


class Authenticate:
    """ASGI middleware: a known API key, and a free slot for its client."""

    def __init__(self, app: ASGIApp, keys: KeyRing, max_in_flight: int) -> None:
        self.app = app
        self.keys = keys
        self.max_in_flight = max_in_flight
        self.in_flight: Counter[str] = Counter()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        scheme, _, key = headers.get(b"authorization", b"").decode(errors="replace").partition(" ")
        owner = self.keys.client_of(key.strip()) if scheme.lower() == "bearer" else None
        if owner is None:
            error = GatewayHttpError(
                401,
                "no valid API key: send `Authorization: Bearer <key>` with a key made by "
                "`lorafleet auth api-key NAME`",
                code="invalid_api_key",
            )
            await _refuse(error, scope, receive, send, None)
            return
        if self.in_flight[owner] >= self.max_in_flight:
            error = GatewayHttpError(
                429,
                f"this key has {self.max_in_flight} requests in flight already: wait for "
                "one to finish (LORAFLEET_GATEWAY_MAX_REQUESTS_PER_KEY sets the limit)",
                code="rate_limit_exceeded",
            )
            await _refuse(error, scope, receive, send, owner)
            return
        scope.setdefault("state", {})["owner"] = owner
        self.in_flight[owner] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[owner] -= 1


async def _refuse(
    error: GatewayHttpError, scope: Scope, receive: Receive, send: Send, owner: str | None
) -> None:
    _log_refused(error, scope.get("path", ""), owner)
    await error.response()(scope, receive, send)


def _log_refused(error: GatewayHttpError, path: str, owner: str | None) -> None:
    log.get().info(
        log.Event.GATEWAY_REFUSED, status=error.status, path=path, client=owner,
        code=error.code, message=error.message,
    )  # fmt: skip


async def _on_error(request: Request, exc: Exception) -> Response:
    if isinstance(exc, GatewayHttpError):
        error = exc
    elif isinstance(exc, HTTPException):  # Starlette's own: no route, wrong method
        error = GatewayHttpError(
            exc.status_code,
            f"{request.method} {request.url.path}: {exc.detail}; docs/gateway.md lists "
            "what the gateway serves",
            code="unknown_route",
        )
    elif isinstance(exc, ApiError):
        error = from_lorafleet(exc)
    else:
        error = unavailable(exc)
    _log_refused(error, request.url.path, request.scope.get("state", {}).get("owner"))
    return error.response()


# --- models and inference ------------------------------------------------------------


async def list_models(request: Request) -> Response:
    ctx, owner = GatewayContext.of(request), owner_of(request)
    catalog, served, jobs = await asyncio.gather(
        ctx.client.models(), ctx.routes.served(), ctx.state.jobs(owner)
    )
    ids = [f.job_id for f in jobs][-LISTED_JOBS_LIMIT:]
    done, serving = await asyncio.gather(
        ctx.client.jobs(JobListRequest(ids=ids, state=JobState.DONE, limit=LISTED_JOBS_LIMIT)),
        ctx.client.adapters(ids, state=ServingState.SERVED, limit=LISTED_JOBS_LIMIT),
    )
    fields_of = {f.job_id: f for f in jobs}
    models: dict[str, Model] = {}
    for m in catalog:
        models[m.name] = Model(id=m.name, created=jm.unix(m.created_at) or 0, owned_by="lorafleet")
    for job in sorted(done, key=lambda j: j.created_at):
        fields = fields_of[job.id]
        name = jm.fine_tuned_model_name(fields.model, fields.suffix, job.id)
        models[name] = Model(id=name, created=jm.unix(job.finished_at) or 0, owned_by=owner)
        models[name].served_by = [engine_base_url(r.engine) for r in serving if r.job_id == job.id]
    now = int(dt.datetime.now(dt.UTC).timestamp())
    for name, routes in served.items():
        model = models.setdefault(name, Model(id=name, created=now, owned_by="engine"))
        model.served_by = list(dict.fromkeys([*model.served_by, *(r.base_url for r in routes)]))
    return json_response(Page(data=list(models.values())))


async def unserved_message(ctx: GatewayContext, model: str) -> str:
    """The 404's message for a model no engine serves now: for a fine-tuned
    name, where its adapter stands (being loaded: retry; refused: the flag)."""
    tuned = fine_tuned_parts(model)
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
        self._turn = itertools.count()

    async def handle(self, request: Request) -> Response:
        ctx = GatewayContext.of(request)
        body = await request.body()
        try:
            model = msgspec.json.decode(body, type=_ModelOnly).model
        except msgspec.DecodeError as e:
            raise bad_request(f"the request body has no model: {e}", "model") from None
        routes = await ctx.routes.where(model)
        if not routes:
            raise not_found(await unserved_message(ctx, model), "model", code="model_not_found")
        route = routes[next(self._turn) % len(routes)]
        if route.served_name is not None and route.served_name != model:
            body = with_model(body, route.served_name)
        reply = await self._forward(ctx.http, route, body)
        if reply.status_code == 404 and fine_tuned_parts(model) is not None:
            # Its adapter was unloaded since the route was read (the TTL):
            # the engine's own 404 would name the served name, not the model.
            ctx.routes.forget(model, route)
            raise not_found(await unserved_message(ctx, model), "model", code="model_not_found")
        return reply

    async def _forward(self, http: httpx2.AsyncClient, route: EngineRoute, body: bytes) -> Response:
        headers = {"content-type": "application/json"}
        if route.api_key:
            headers["authorization"] = f"Bearer {route.api_key}"
        outgoing = http.build_request(
            "POST", f"{route.base_url}/{self.path}", content=body, headers=headers,
            timeout=httpx2.Timeout(None, connect=ENGINE_CONNECT_TIMEOUT_S),
        )  # fmt: skip
        try:
            reply = await http.send(outgoing, stream=True)
        except httpx2.HTTPError as e:
            raise GatewayHttpError(
                503, f"the engine at {route.base_url} did not answer ({e!r}): retry, or "
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
            return Response(body, status_code=reply.status_code, media_type=media_type or None)
        return StreamingResponse(
            reply.aiter_raw(),
            status_code=reply.status_code,
            media_type=media_type,
            background=BackgroundTask(reply.aclose),
        )


def make_app(ctx: GatewayContext, keys: KeyRing) -> ASGIApp:
    routes = [
        Route("/v1/files", tr.create_file, methods=["POST"]),
        Route("/v1/files", tr.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", tr.retrieve_file, methods=["GET"]),
        Route("/v1/files/{file_id}", tr.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", tr.file_content, methods=["GET"]),
        Route("/v1/fine_tuning/jobs", tr.create_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs", tr.list_jobs, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}", tr.retrieve_job, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}/cancel", tr.cancel_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/pause", tr.pause_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/resume", tr.resume_job, methods=["POST"]),
        Route("/v1/fine_tuning/jobs/{job_id}/events", tr.job_events, methods=["GET"]),
        Route("/v1/fine_tuning/jobs/{job_id}/checkpoints", tr.job_checkpoints, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/chat/completions", Inference("chat/completions").handle, methods=["POST"]),
        Route("/v1/completions", Inference("completions").handle, methods=["POST"]),
    ]
    errors: dict[Any, Any] = {
        HTTPException: _on_error,
        GatewayHttpError: _on_error,
        ApiError: _on_error,
        nats.errors.NoRespondersError: _on_error,
        nats.errors.TimeoutError: _on_error,
        TimeoutError: _on_error,
    }
    app = Starlette(routes=routes, exception_handlers=errors)
    app.state.ctx = ctx
    return Authenticate(app, keys, ctx.config.max_requests_per_key)
