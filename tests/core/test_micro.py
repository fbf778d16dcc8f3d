"""lorafleet services speak the NATS micro protocol: `nats micro ls/info/stats` work,
and an error reply carries both the micro headers and the JSON body, and counts."""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats.errors
import pytest
from nats.micro.service import Service

from lorafleet.errors import BadRequestError
from lorafleet.nats import _bus as bus
from lorafleet.nats._micro import Route, start_service
from lorafleet.settings import Settings


class Echo(msgspec.Struct, forbid_unknown_fields=True):
    text: str


async def echo(req: Echo) -> Echo:
    if req.text == "no":
        raise BadRequestError("$.text: 'no' is refused; send anything else", field="$.text")
    return req


async def test_micro_discovery_stats_and_error_replies(settings: Settings) -> None:
    nc = await bus.connect(settings, "test")
    svc = await start_service(
        nc, "lorafleet-echo", "1.2.3", "echoes", [Route("t.echo", Echo, echo)], "q"
    )
    ok = await nc.request("t.echo", b'{"text": "hi"}', timeout=2)
    assert json.loads(ok.data) == {"text": "hi"}
    refused = await nc.request("t.echo", b'{"text": "no"}', timeout=2)
    assert refused.headers is not None
    assert refused.headers["Nats-Service-Error-Code"] == "400"
    assert "refused" in refused.headers["Nats-Service-Error"]
    body = json.loads(refused.data)["error"]
    assert body == {
        "code": "bad_request",
        "message": "$.text: 'no' is refused; send anything else",
        "field": "$.text",
    }
    unknown = await nc.request("t.echo", b'{"text": "hi", "x": 1}', timeout=2)
    assert json.loads(unknown.data)["error"]["field"] == "$.x"

    ping = json.loads((await nc.request("$SRV.PING.lorafleet-echo", b"", timeout=2)).data)
    assert ping["name"] == "lorafleet-echo" and ping["version"] == "1.2.3"
    info = json.loads((await nc.request("$SRV.INFO.lorafleet-echo", b"", timeout=2)).data)
    assert [e["subject"] for e in info["endpoints"]] == ["t.echo"]
    stats = json.loads((await nc.request("$SRV.STATS.lorafleet-echo", b"", timeout=2)).data)
    [ep] = stats["endpoints"]
    assert ep["num_requests"] == 3
    assert ep["num_errors"] == 2
    assert ep["last_error"].startswith("400: $.x")
    await svc.stop()
    await nc.close()


async def test_request_waits_out_a_moment_without_responders(settings: Settings) -> None:
    """A responder that is (re)connecting is missed for a moment: bus.request
    tries again for `no_responders_retry_s`, then gives up with NoRespondersError."""
    nc = await bus.connect(settings, "test")
    with pytest.raises(nats.errors.NoRespondersError):
        await bus.request(nc, "t.late", Echo(text="hi"), Echo, no_responders_retry_s=0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(nats.errors.NoRespondersError):
        await bus.request(nc, "t.late", Echo(text="hi"), Echo, no_responders_retry_s=0.3)
    assert 0.3 <= loop.time() - started < 2.0

    async def serve_later() -> Service:
        await asyncio.sleep(0.3)
        return await start_service(nc, "late", "0.0.1", "late", [Route("t.late", Echo, echo)], "q")

    later = asyncio.create_task(serve_later())
    reply = await bus.request(nc, "t.late", Echo(text="hi"), Echo, no_responders_retry_s=5)
    assert reply == Echo(text="hi")
    with pytest.raises(BadRequestError, match="refused") as refused:
        await bus.request(nc, "t.late", Echo(text="no"), Echo)
    assert refused.value.field == "$.text"
    await (await later).stop()
    await nc.close()
