"""The gateway's HTTP application: its routes, authentication and errors.

Starlette (gateway/DESIGN.md says why): every route needs an API key
(`Authorization: Bearer lf-...`, api_keys.py), whose project owns what the
request makes and sees (tenancy.py); a key that has `max_requests_per_key`
requests in flight gets a 429. Every error is
OpenAI's shape (http_errors.py), logged once as `gateway.refused`.

Inference and `GET /v1/models`: inference_routes.py; the fine-tuning API:
training_routes.py.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import nats.errors
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from lorafleet import log
from lorafleet.artifacts import PublishRefusedError
from lorafleet.errors import ApiError
from lorafleet_services.gateway import inference_routes as inference
from lorafleet_services.gateway import training_routes as tr
from lorafleet_services.gateway.api_keys import KeyRing
from lorafleet_services.gateway.context import GatewayContext
from lorafleet_services.gateway.http_errors import (
    GatewayHttpError,
    from_lorafleet,
    unavailable,
)


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
        caller = self.keys.caller_of(key.strip()) if scheme.lower() == "bearer" else None
        if caller is None:
            error = GatewayHttpError(
                401,
                "no valid API key (none, unknown or revoked): send `Authorization: Bearer "
                "<key>` with a key made by `lorafleet auth api-key create NAME`",
                code="invalid_api_key",
            )
            await _refuse(error, scope, receive, send, None)
            return
        name = caller.key
        if self.in_flight[name] >= self.max_in_flight:
            error = GatewayHttpError(
                429,
                f"this key has {self.max_in_flight} requests in flight already: wait for "
                "one to finish (LORAFLEET_GATEWAY_MAX_REQUESTS_PER_KEY sets the limit)",
                code="rate_limit_exceeded",
            )
            await _refuse(error, scope, receive, send, name)
            return
        scope.setdefault("state", {}).update(owner=caller.project, key=caller.key)
        self.in_flight[name] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[name] -= 1


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
            f"{request.method} {request.url.path}: {exc.detail}; docs/fine-tune-and-serve.md "
            "lists what the gateway serves",
            code="unknown_route",
        )
    elif isinstance(exc, ApiError):
        error = from_lorafleet(exc)
    else:
        error = unavailable(exc)
    _log_refused(error, request.url.path, request.scope.get("state", {}).get("owner"))
    return error.response()


#: What becomes an OpenAI-shaped error rather than Starlette's bare 500.
EXCEPTION_HANDLERS: dict[Any, Any] = {
    HTTPException: _on_error,
    GatewayHttpError: _on_error,
    ApiError: _on_error,
    # Every NATS error, JetStream's too (a stream mid-election answers 503,
    # a reconnecting client refuses): the upload during a NATS member's
    # restart in tests/deploy was a bare 500 before.
    nats.errors.Error: _on_error,
    TimeoutError: _on_error,
    # A chunk's publish that no stream took (its stream leaderless while a
    # member's link crawled: nemesis seed 12) or that JetStream refused.
    PublishRefusedError: _on_error,
}


# --- models and inference ------------------------------------------------------------


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
        Route("/v1/models", inference.list_models, methods=["GET"]),
        Route(
            "/v1/chat/completions", inference.Inference("chat/completions").handle, methods=["POST"]
        ),
        Route("/v1/completions", inference.Inference("completions").handle, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS)
    app.state.ctx = ctx
    return Authenticate(app, keys, ctx.config.max_requests_per_key)
