"""lorafleet services speak the NATS micro protocol: `nats micro ls/info/stats` work,
and an error reply carries both the micro headers and the JSON body, and counts."""

from __future__ import annotations

import asyncio
import json

import msgspec
import nats.aio.msg
import nats.errors
import nats.js.errors
import pytest
from nats.micro.service import Service

from lorafleet.errors import BadRequestError, UnavailableError
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


async def test_a_read_whose_reply_was_lost_is_asked_once_more(settings: Settings) -> None:
    """A responder that holds the first request and never answers (killed
    with it, or the reply gone with a NATS server): an idempotent request is
    sent again and answered; any other times out, and no read is sent a third time."""
    nc = await bus.connect(settings, "test")
    heard: list[bytes] = []

    async def answers_from_the_second(msg: nats.aio.msg.Msg) -> None:
        heard.append(msg.data)
        if len(heard) % 2 == 0:
            await msg.respond(msg.data)

    await nc.subscribe("t.lossy", cb=answers_from_the_second)
    read = await bus.request(nc, "t.lossy", Echo("a"), Echo, timeout_s=0.5, idempotent=True)
    assert (read, len(heard)) == (Echo("a"), 2)
    with pytest.raises(nats.errors.TimeoutError):
        await bus.request(nc, "t.lossy", Echo("b"), Echo, timeout_s=0.5)
    assert len(heard) == 3

    async def never() -> None:
        heard.append(b"never")
        raise nats.errors.TimeoutError

    with pytest.raises(nats.errors.TimeoutError):
        await bus.once_more_on_timeout(never)
    assert heard[3:] == [b"never", b"never"]
    await nc.close()


async def test_an_answer_no_nats_message_holds_is_refused_saying_what_to_ask(
    settings: Settings,
) -> None:
    """A reply over the server's max_payload (a thousand jobs at once, seen
    at a 30-minute nemesis run's end) was an `internal` MaxPayloadError."""
    nc = await bus.connect(settings, "test")

    async def huge(req: Echo) -> Echo:
        return Echo(req.text * (nc.max_payload // len(req.text) + 1))

    await start_service(
        nc, "lorafleet-huge", "1.0.0", "too much", [Route("t.huge", Echo, huge)], "q"
    )
    with pytest.raises(BadRequestError, match=r"more than a NATS message holds.*`after`"):
        await bus.request(nc, "t.huge", Echo("0123456789"), Echo)
    await nc.close()


@pytest.mark.parametrize(
    "error",
    [
        nats.js.errors.ServiceUnavailableError(
            code=503, err_code=10008, description="JetStream system temporarily unavailable"
        ),
        # A publish no stream took: nemesis seed 47, a submit during nats.isolate.
        nats.js.errors.NoStreamResponseError(),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_jetstreams_own_unavailability_is_unavailable_not_internal(
    settings: Settings, error: Exception
) -> None:
    """Nemesis seed 25: a submit whose dataset write met JetStream's 503
    ("temporarily unavailable", mid-election) answered `internal`, a 500
    through the gateway, which clients do not retry."""
    nc = await bus.connect(settings, "test")

    async def electing(req: Echo) -> Echo:
        raise error

    await start_service(nc, "lorafleet-electing", "1.0.0", "mid-election",
                        [Route("t.electing", Echo, electing)], "q")  # fmt: skip
    with pytest.raises(UnavailableError, match=r"temporarily unavailable.*retry"):
        await bus.request(nc, "t.electing", Echo("x"), Echo)
    await nc.close()
