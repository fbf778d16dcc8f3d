"""What a client sees when the bus, not a service, refuses a request: an
OpenAI-shaped 503 that says to retry (the SDK retries it), never a bare 500.
The rolling restart in tests/deploy met a JetStream error on an upload while
a NATS member restarted, and answered 500."""

from __future__ import annotations

import httpx2
import nats.errors
import nats.js.errors
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from lorafleet.artifacts import NoStreamError, PublishRefusedError
from lorafleet_services.gateway.app import EXCEPTION_HANDLERS

BUS_ERRORS = [
    nats.js.errors.ServiceUnavailableError(
        code=503, description="JetStream system temporarily unavailable"
    ),
    nats.errors.ConnectionReconnectingError(),
    nats.errors.NoRespondersError(),
    nats.errors.TimeoutError(),
    TimeoutError(),
    # An upload's chunk no stream took (nemesis seed 12: a bare 500 before).
    NoStreamError("no stream answered (no responders)", 503),
    PublishRefusedError("insufficient resources", 503, 10047),
]


@pytest.mark.parametrize("error", BUS_ERRORS, ids=lambda e: type(e).__name__)
async def test_a_bus_error_is_a_503_that_says_retry(error: Exception) -> None:
    async def raises(request: Request) -> Response:
        raise error

    app = Starlette(routes=[Route("/v1/files", raises, methods=["POST"])],
                    exception_handlers=EXCEPTION_HANDLERS)  # fmt: skip
    transport = httpx2.ASGITransport(app=app)
    async with httpx2.AsyncClient(transport=transport, base_url="http://gateway") as http:
        reply = await http.post("/v1/files")
    assert reply.status_code == 503, reply.text
    body = reply.json()["error"]
    assert body["code"] == "unavailable" and body["type"] == "server_error"
    assert "retry in a few seconds" in body["message"], body
