"""Registering a lorafleet service with the NATS micro protocol.

`nats micro ls` lists each service, `nats micro stats NAME` counts its
requests and errors. Handlers stay thin: `endpoint()` decodes the request
strictly into its Struct, calls a plain async function, encodes the reply,
and turns every failure into an error reply carrying both the micro headers
(Nats-Service-Error, Nats-Service-Error-Code) and the JSON body
`{"error": {"code": ..., "message": ..., "field": ...}}`.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import msgspec.inspect
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request
from nats.micro.service import Endpoint, EndpointConfig, Service, ServiceConfig

import lorafleet.log as log
import lorafleet.metrics as metrics
from lorafleet.errors import (
    HTTP_CODES,
    ApiError,
    BadRequestError,
    InternalError,
    UnavailableError,
)
from lorafleet.log import Event
from lorafleet.nats._bus import encode
from lorafleet.nats._natspy import count_endpoint_error, last_endpoint

Req = TypeVar("Req")

_PATH_RE = re.compile(r"^(?P<what>.*?) - at `(?P<path>[^`]+)`$", re.S)
_KEY_RE = re.compile(r"^Object (?P<kind>contains unknown|missing required) field `(?P<key>[^`]+)`$")


_STEP_RE = re.compile(r"\.([^.\[]+)|\[(\d+)\]")


def _choices_at(typ: Any, path: str) -> list[str] | None:
    """The values an enum or Literal field at `path` (`$.params.dtype`) accepts."""
    info: Any = msgspec.inspect.type_info(typ)

    def unwrap(i: Any) -> Any:
        if isinstance(i, msgspec.inspect.UnionType):
            rest = [t for t in i.types if not isinstance(t, msgspec.inspect.NoneType)]
            return rest[0] if len(rest) == 1 else i
        return i

    for name, index in _STEP_RE.findall(path[1:]):
        info = unwrap(info)
        if index and isinstance(info, msgspec.inspect.ListType):
            info = info.item_type
        elif name and isinstance(info, msgspec.inspect.StructType):
            found = [f.type for f in info.fields if f.encode_name == name]
            if not found:
                return None
            info = found[0]
        else:
            return None
    info = unwrap(info)
    if isinstance(info, msgspec.inspect.EnumType):
        return [str(member.value) for member in info.cls]
    if isinstance(info, msgspec.inspect.LiteralType):
        return [str(v) for v in info.values]
    return None


def decode_request(data: bytes, typ: type[Req]) -> Req:
    """Decode strictly; a bad request raises BadRequestError naming the field at fault."""
    if not data.strip():
        raise BadRequestError("the request is empty: send a JSON object")
    try:
        return msgspec.json.decode(data, type=typ)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _PATH_RE.match(text)
        what, path = (m.group("what"), m.group("path")) if m else (text, "$")
        # msgspec names an unknown or missing key in the text, not in the path.
        key = _KEY_RE.match(what)
        if key:
            field = f"{path}.{key.group('key')}"
            hint = "remove it" if key.group("kind") == "contains unknown" else "add it"
            raise BadRequestError(f"{field}: {what}; {hint}", field=field) from None
        if m:
            choices = _choices_at(typ, path) if what.startswith("Invalid enum value") else None
            if choices:
                what += "; use one of: " + ", ".join(choices)
            raise BadRequestError(f"{path}: {what}", field=path) from None
        raise BadRequestError(text) from None
    except msgspec.DecodeError as e:
        raise BadRequestError(f"the request is not valid JSON: {e}") from None


#: JetStream's own 503s: an API call's (a member catching up, a leader being
#: elected) and a publish's that no stream took (its leader unreachable
#: from this member: nemesis seed 47, a submit during `nats.isolate`).
JETSTREAM_UNAVAILABLE = (
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)


def jetstream_unavailable(e: Exception) -> UnavailableError:
    """One of JETSTREAM_UNAVAILABLE: the request's step did not happen, and
    a retry is what it needs (nemesis seed 25: a submit's dataset write
    answered `internal`, a gateway 500)."""
    return UnavailableError(
        f"JetStream is temporarily unavailable ({getattr(e, 'description', None) or e}): "
        "a NATS member is down or a leader is being elected; retry in a few seconds"
    )


def too_big(size: int) -> BadRequestError:
    """An answer of `size` bytes that no NATS message holds (a thousand jobs)."""
    return BadRequestError(
        f"the answer is {size:,} bytes, more than a NATS message holds (the server's "
        "max_payload): ask for less at once (a smaller limit, a narrower filter, or the "
        "next page with `after`)"
    )


def endpoint(
    typ: type[Req],
    fn: Callable[[Req], Awaitable[Any]],
    subject: str,
    on_error: Callable[[str], None] | None = None,
) -> Callable[[Request], Awaitable[None]]:
    """A micro handler: decode as `typ`, run `fn`, reply with its result encoded.

    on_error: told "<code>: <message>" of every error reply.
    """
    logger = log.get()
    metrics.endpoint_metrics(subject)
    requests = metrics.API_REQUESTS.labels(subject)
    duration = metrics.API_DURATION.labels(subject)

    async def fail(req: Request, e: ApiError) -> None:
        http = HTTP_CODES[e.code]
        metrics.API_ERRORS.labels(subject, e.code.value).inc()
        if on_error is not None:
            on_error(f"{http}: {e.message}")
        await req.respond_error(http, e.message, data=e.body())

    async def answer(req: Request) -> None:
        try:
            result = await fn(decode_request(req.data, typ))
        except ApiError as e:
            await fail(req, e)
            return
        except JETSTREAM_UNAVAILABLE as e:
            await fail(req, jetstream_unavailable(e))
            return
        except Exception as e:
            logger.exception(Event.REQUEST_FAILED, subject=subject, error=repr(e))
            await fail(
                req, InternalError(f"the service failed on this request: {e!r}; it is logged")
            )
            return
        data = result if isinstance(result, bytes) else encode(result)
        try:
            await req.respond(data)
        except nats.errors.MaxPayloadError:
            await fail(req, too_big(len(data)))

    async def handle(req: Request) -> None:
        started = time.perf_counter()
        try:
            await answer(req)
        finally:
            requests.inc()
            duration.observe(time.perf_counter() - started)

    return handle


@dataclass(frozen=True, slots=True)
class Route:
    """One endpoint: its subject, request Struct and plain handler function."""

    subject: str
    request_type: Any
    fn: Callable[[Any], Awaitable[Any]]


async def start_service(
    nc: Client,
    name: str,
    version: str,
    description: str,
    routes: list[Route],
    queue_group: str,
) -> Service:
    """Register `name` with the micro protocol and subscribe every route.

    Replicas of a service share `queue_group`, so each request is answered once.
    """
    svc = await add_service(
        nc,
        ServiceConfig(name=name, version=version, description=description, queue_group=queue_group),
    )
    for r in routes:
        await _add_route(svc, r, queue_group)
    return svc


async def _add_route(svc: Service, route: Route, queue_group: str) -> None:
    # micro counts only what a handler raises; ours answer with a JSON body
    # as well, so their error replies are counted here, where
    # `nats micro stats` reads them. The endpoint exists only once added.
    added: list[Endpoint] = []

    def count(error: str) -> None:
        if added:
            count_endpoint_error(added[0], error)

    await svc.add_endpoint(
        EndpointConfig(
            name=route.subject.replace(".", "-"),
            subject=route.subject,
            handler=endpoint(route.request_type, route.fn, route.subject, on_error=count),
            queue_group=queue_group,
        )
    )
    added.append(last_endpoint(svc))
