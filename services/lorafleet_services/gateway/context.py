"""What every gateway handler works with, and the few helpers they share."""

from __future__ import annotations

import io
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import httpx2
import msgspec
from nats.js import JetStreamContext
from starlette.requests import Request
from starlette.responses import Response

from lorafleet.client import Client
from lorafleet.objects import ObjectNotFoundError, read_object
from lorafleet_services.gateway.config import GatewayConfig
from lorafleet_services.gateway.http_errors import not_found
from lorafleet_services.gateway.model_location import ModelLocator
from lorafleet_services.gateway.replica_choice import Loads
from lorafleet_services.gateway.state import GatewayState

_encoder = msgspec.json.Encoder()


@dataclass
class GatewayContext:
    """The gateway's connections: lorafleet, its own state, the engines."""

    config: GatewayConfig
    client: Client
    state: GatewayState
    locator: ModelLocator
    http: httpx2.AsyncClient
    #: Where uploads' records are checked (a worker process: uploads.py).
    checker: Executor
    #: Requests in flight per engine: which replica a completion goes to.
    loads: Loads = field(default_factory=Loads)

    @staticmethod
    def of(request: Request) -> GatewayContext:
        ctx: GatewayContext = request.app.state.ctx
        return ctx

    async def read_dataset(self, name: str) -> bytes:
        """The bytes of a dataset object (by message gets: a client's right)."""
        js: JetStreamContext = self.client.js
        out = io.BytesIO()
        try:
            await read_object(js, self.client.names.datasets_bucket, name, out)
        except ObjectNotFoundError:
            raise not_found(
                f"the data of this file ({name}) is gone from the datasets bucket"
            ) from None
        return out.getvalue()


def owner_of(request: Request) -> str:
    """The project of the API key the request came with (set by the auth
    middleware): what it owns is stored under this name (tenancy.py)."""
    owner: str = request.scope["state"]["owner"]
    return owner


def json_response(body: Any, status: int = 200) -> Response:
    return Response(_encoder.encode(body), status_code=status, media_type="application/json")
