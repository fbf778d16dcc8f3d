"""The one ordered publisher (lorafleet/nats/_publisher.py), against a real
nats-server: in order, each until acknowledged, a retry stored once."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import StreamConfig

from lorafleet.nats import _bus as bus
from lorafleet.nats._publisher import OrderedPublisher, Outgoing
from lorafleet.settings import Settings
from tests.eventually import eventually

STREAM = "TEST_ORDERED"
SUBJECT = "test.ordered.a"


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[Client]:
    conn = await bus.connect(settings, "ordered-publisher-under-test")
    try:
        yield conn
    finally:
        await bus.drain_quietly(conn)


def msg(seq: int) -> Outgoing:
    return Outgoing(SUBJECT, str(seq).encode(), msg_id=f"m.{seq}", seq=seq)


async def stored(js: JetStreamContext) -> list[bytes]:
    info = await js.stream_info(STREAM)
    return [
        (await js.get_msg(STREAM, s)).data or b""
        for s in range(info.state.first_seq, info.state.last_seq + 1)
    ]


async def test_messages_go_out_in_order_each_stored_once(nc: Client) -> None:
    js = nc.jetstream()
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
    publisher = OrderedPublisher(js, name="test")
    publisher.start()
    for seq in (1, 2, 2, 3):  # 2 twice: a retry of it, the same id
        publisher.put(msg(seq))
    assert await publisher.stop(timeout_s=10) == 0
    assert publisher.published == 4
    assert await stored(js) == [b"1", b"2", b"3"]


async def test_a_refused_message_is_retried_and_holds_back_the_ones_after_it(nc: Client) -> None:
    js = nc.jetstream()
    retried: list[int] = []
    publisher = OrderedPublisher(
        js, name="test", on_retry=lambda m, _e: retried.append(m.seq), publish_timeout_s=0.2
    )
    publisher.start()
    for seq in (1, 2, 3):
        publisher.put(msg(seq))
    # No stream yet: every publish is refused (no responders), the first one retried.
    await eventually(lambda: len(retried) >= 2, "two tries of the first message")
    assert set(retried) == {1} and publisher.unpublished == 3
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
    assert await publisher.stop(timeout_s=10) == 0
    assert await stored(js) == [b"1", b"2", b"3"]


async def test_a_message_refused_past_give_up_s_is_dropped_and_the_next_goes(
    nc: Client,
) -> None:
    js = nc.jetstream()
    dropped: list[int] = []
    publisher = OrderedPublisher(
        js,
        name="test",
        give_up_s=0.5,
        on_dropped=lambda m, _e: dropped.append(m.seq),
        publish_timeout_s=0.1,
    )
    publisher.start()
    publisher.put(msg(1))
    await eventually(lambda: dropped == [1], "the first message dropped")
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECT]))
    publisher.put(msg(2))
    assert await publisher.stop(timeout_s=10) == 0
    assert (publisher.published, publisher.dropped) == (1, 1)
    assert await stored(js) == [b"2"]


async def test_a_stop_that_runs_out_of_time_says_what_it_left(nc: Client) -> None:
    publisher = OrderedPublisher(nc.jetstream(), name="test", publish_timeout_s=0.1)
    publisher.start()
    for seq in (1, 2):
        publisher.put(msg(seq))
    assert await publisher.stop(timeout_s=0.3) == 2, "no stream: neither went out"
    assert publisher.abandon() == 0, "each loss is counted once (a job abandons, then stops)"
    assert publisher.unpublished == 2
