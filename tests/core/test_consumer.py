"""The one pull-consumer loop (lorafleet.nats._consumer) against a real nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy, StreamConfig
from structlog.testing import capture_logs

from lorafleet.nats import _bus as bus
from lorafleet.nats._consumer import PullConsumer, PullConsumerConfig
from lorafleet.nats.server import NatsServer
from lorafleet.settings import Settings
from tests.consumers import redeliveries
from tests.eventually import eventually

STREAM = "TEST_EVENTS"
SUBJECTS = "test.events.>"
CONFIG = PullConsumerConfig(
    stream=STREAM,
    durable="test-consumer",
    filter_subject=SUBJECTS,
    ack_wait_s=30.0,
    max_ack_pending=1000,
    batch=16,
    fetch_wait_s=0.2,
)


@dataclass
class Applied:
    """A handler that records each message's payload and acks it after recording."""

    payloads: list[bytes] = field(default_factory=list)
    batches: int = 0
    fail_next: int = 0

    async def __call__(self, msgs: list[Msg]) -> None:
        self.batches += 1
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("the database is away")
        for m in msgs:
            self.payloads.append(m.data)
            await m.ack()


@pytest.fixture
async def nc(settings: Settings) -> AsyncIterator[Client]:
    conn = await bus.connect(settings, "consumer-under-test")
    await conn.jetstream().add_stream(StreamConfig(name=STREAM, subjects=[SUBJECTS]))
    try:
        yield conn
    finally:
        await bus.drain_quietly(conn)


async def publish(js: JetStreamContext, *payloads: bytes) -> None:
    for p in payloads:
        await js.publish("test.events.a", p)


async def ensure_stream(js: JetStreamContext) -> None:
    await js.add_stream(StreamConfig(name=STREAM, subjects=[SUBJECTS]))


async def test_delivery_goes_on_after_a_server_restart(nc: Client, nats_server: NatsServer) -> None:
    js = nc.jetstream()
    applied = Applied()
    consumer = PullConsumer(js, CONFIG, applied)
    await consumer.start()
    try:
        await publish(js, b"1", b"2", b"3")
        await eventually(lambda: len(applied.payloads) == 3, "the first three applied")
        await nats_server.restart()
        await eventually(
            lambda: js.publish("test.events.a", b"4"),
            "a publish after the restart",
            retry_on=(Exception,),
        )
        await publish(js, b"5")
        await eventually(lambda: applied.payloads, "all five applied", until=lambda p: len(p) >= 5)
        assert applied.payloads == [b"1", b"2", b"3", b"4", b"5"]
    finally:
        await consumer.stop()


async def test_a_deleted_consumer_is_recreated_and_replays(nc: Client) -> None:
    js = nc.jetstream()
    applied = Applied()

    async def recreate_stream() -> None:
        await ensure_stream(js)

    consumer = PullConsumer(js, CONFIG, applied, ensure_stream=recreate_stream, check_every_s=0.3)
    await consumer.start()
    try:
        await publish(js, b"1", b"2")
        await eventually(lambda: len(applied.payloads) == 2, "the first two applied")
        await js.delete_consumer(STREAM, CONFIG.durable)
        await publish(js, b"3")
        await eventually(
            lambda: applied.payloads, "the replay and the new one", until=lambda p: b"3" in p
        )
        # The new consumer starts from the stream's start: 1 and 2 come again.
        assert applied.payloads == [b"1", b"2", b"1", b"2", b"3"]
        info = await js.consumer_info(STREAM, CONFIG.durable)
        assert info.config.ack_wait == CONFIG.ack_wait_s
    finally:
        await consumer.stop()


async def test_a_deleted_stream_comes_back_through_ensure_stream(nc: Client) -> None:
    """A server back with a fresh store has neither the stream nor the consumer."""
    js = nc.jetstream()
    applied = Applied()
    ensured: list[int] = []

    async def recreate_stream() -> None:
        await ensure_stream(js)
        ensured.append(1)  # only once it is there: the test publishes into it next

    consumer = PullConsumer(js, CONFIG, applied, ensure_stream=recreate_stream, check_every_s=0.3)
    await consumer.start()
    try:
        await publish(js, b"1")
        await eventually(lambda: applied.payloads == [b"1"], "the first applied")
        await js.delete_stream(STREAM)
        await eventually(lambda: ensured, "the stream re-created", timeout_s=10)
        await publish(js, b"2")
        await eventually(lambda: b"2" in applied.payloads, "the one after the re-creation")
        assert applied.payloads == [b"1", b"2"]
    finally:
        await consumer.stop()


async def test_a_handler_that_raises_gets_its_messages_again(nc: Client) -> None:
    js = nc.jetstream()
    applied = Applied(fail_next=2)
    consumer = PullConsumer(js, CONFIG, applied)
    await consumer.start()
    try:
        await publish(js, b"1", b"2", b"3")
        # Nakked, not acked: redelivered well before the 30 s ack wait.
        await eventually(
            lambda: applied.payloads, "the batch applied", until=lambda p: len(p) >= 3,
            timeout_s=10,
        )  # fmt: skip
        assert sorted(applied.payloads) == [b"1", b"2", b"3"]
        assert applied.batches >= 3
        # The handler's acks are publishes the server takes in its own time
        # (the last one can follow the last payload's append): wait for them.
        info = await eventually(
            lambda: js.consumer_info(STREAM, CONFIG.durable), "every message acked",
            until=lambda i: i.num_ack_pending == 0, timeout_s=5,
        )  # fmt: skip
        assert info.num_pending == 0 and redeliveries(info) >= 2  # the two nakked batches
    finally:
        await consumer.stop()


async def test_stop_finishes_the_batch_in_hand_and_leaves_the_rest(nc: Client) -> None:
    js = nc.jetstream()
    started = asyncio.Event()
    release = asyncio.Event()
    seen: list[bytes] = []

    async def slow(msgs: list[Msg]) -> None:
        started.set()
        await release.wait()
        for m in msgs:
            seen.append(m.data)
            await m.ack()

    consumer = PullConsumer(js, CONFIG, slow)
    await consumer.start()
    await publish(js, b"1")
    await asyncio.wait_for(started.wait(), 10)
    stopping = asyncio.create_task(consumer.stop())
    await asyncio.sleep(0.3)
    assert not stopping.done(), "stop() did not wait for the batch in hand"
    release.set()
    await asyncio.wait_for(stopping, 10)
    assert seen == [b"1"]
    await publish(js, b"2")
    await asyncio.sleep(0.5)
    assert seen == [b"1"], "a stopped consumer still fetched"
    info = await eventually(
        lambda: js.consumer_info(STREAM, CONFIG.durable), "the batch in hand acked",
        until=lambda i: i.num_ack_pending == 0, timeout_s=5,
    )  # fmt: skip
    assert info.num_pending == 1


async def test_on_tick_runs_while_idle(nc: Client) -> None:
    js = nc.jetstream()
    ticks: list[float] = []

    async def tick() -> None:
        ticks.append(asyncio.get_running_loop().time())

    consumer = PullConsumer(js, CONFIG, Applied(), on_tick=tick, tick_s=0.1)
    await consumer.start()
    try:
        await eventually(lambda: len(ticks) >= 3, "three ticks with nothing to fetch")
    finally:
        await consumer.stop()
    with pytest.raises(ValueError, match="together"):
        PullConsumer(js, CONFIG, Applied(), on_tick=tick)


async def test_a_batch_in_hand_past_the_ack_wait_is_not_sent_again(nc: Client) -> None:
    """The handler takes 2.5 ack waits over a batch while the loop fetches on
    (nothing else to fetch): told "in progress", the server does not send it
    again to those fetches."""
    js = nc.jetstream()
    config = replace(CONFIG, ack_wait_s=1.0)
    first = asyncio.Event()
    seen: list[bytes] = []

    async def slow_first(msgs: list[Msg]) -> None:
        if not first.is_set():
            first.set()
            await asyncio.sleep(2.5)
        for m in msgs:
            seen.append(m.data)
            await m.ack()

    consumer = PullConsumer(js, config, slow_first)
    await consumer.start()
    try:
        await publish(js, b"1")
        await eventually(lambda: seen, "the slow one applied", timeout_s=10)
        await publish(js, b"2")
        await eventually(lambda: seen, "the next applied", until=lambda s: len(s) >= 2)
        await asyncio.sleep(0.5)
        assert seen == [b"1", b"2"]
        assert redeliveries(await js.consumer_info(STREAM, config.durable)) == 0
    finally:
        await consumer.stop()


async def test_a_handler_stuck_past_max_hold_lets_its_batch_go(nc: Client) -> None:
    js = nc.jetstream()
    config = replace(CONFIG, ack_wait_s=1.0, max_hold_s=1.5)
    release = asyncio.Event()
    consumer = PullConsumer(js, config, lambda msgs: release.wait())
    await consumer.start()
    try:
        await publish(js, b"1")

        async def redelivered() -> int:
            return redeliveries(await js.consumer_info(STREAM, config.durable))

        await eventually(redelivered, "the stuck batch sent again", until=bool, timeout_s=10)
    finally:
        release.set()
        await consumer.stop()


async def test_an_existing_consumer_takes_this_configs_ack_wait(nc: Client) -> None:
    """The server keeps a consumer's settings from its creation: a changed
    ack wait (LORAFLEET_RECORDER_ACK_WAIT_S) must reach the existing one."""
    js = nc.jetstream()
    await js.add_consumer(STREAM, config=replace(CONFIG, ack_wait_s=30.0).consumer_config())
    await publish(js, b"1")
    applied = Applied()
    consumer = PullConsumer(js, replace(CONFIG, ack_wait_s=5.0, max_ack_pending=10), applied)
    await consumer.start()
    try:
        await eventually(lambda: applied.payloads == [b"1"], "the message applied")
        info = await js.consumer_info(STREAM, CONFIG.durable)
        assert info.config.ack_wait == 5.0 and info.config.max_ack_pending == 10
    finally:
        await consumer.stop()


async def test_a_consumer_that_cannot_take_the_settings_is_consumed_as_it_is(nc: Client) -> None:
    """A deliver policy cannot change in place: the update is refused, logged,
    and the loop consumes with the settings the consumer has."""
    js = nc.jetstream()
    old = replace(CONFIG.consumer_config(), ack_wait=30.0, deliver_policy=DeliverPolicy.NEW)
    await js.add_consumer(STREAM, config=old)
    applied = Applied()
    consumer = PullConsumer(js, replace(CONFIG, ack_wait_s=5.0), applied)
    with capture_logs() as logs:
        await consumer.start()
    try:
        await publish(js, b"1")
        await eventually(lambda: applied.payloads == [b"1"], "the message applied")
        assert (await js.consumer_info(STREAM, CONFIG.durable)).config.ack_wait == 30.0
        assert any(line.get("where") == f"{CONFIG.durable} settings" for line in logs), logs
    finally:
        await consumer.stop()
