"""The publisher window and the chunk reader of agent/transfer/delivery.py, without a bus.

A fake publisher records every publish and hands back a future the test
settles, so the window's rules (how many in flight, the last one after all
the others, what is published again and when it gives up) are checked in
process; tests/artifacts/test_delivery.py runs the same code against a
real nats-server.
"""

from __future__ import annotations

import asyncio
import io
from dataclasses import dataclass, field

import pytest

from lorafleet.artifacts import NoStreamError, PublishRefusedError
from lorafleet_services.agent.transfer import delivery
from lorafleet_services.agent.transfer.delivery import (
    MAX_TRIES,
    NO_STREAM_MAX_TRIES,
    Chunk,
    ChunkReader,
    ChunkWindow,
    DeliveryError,
)


@dataclass
class FakePublisher:
    """Publishes into a list; each answer is a future the test settles."""

    published: list[tuple[int, asyncio.Future[int]]] = field(default_factory=list)
    is_connected: bool = True
    is_closed: bool = False

    async def publish(
        self, subject: str, body: bytes, headers: dict[str, str] | None = None
    ) -> asyncio.Future[int]:
        assert headers is not None
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self.published.append((int(headers["seq"]), fut))
        return fut

    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.published]

    def ack_all(self) -> None:
        for _, fut in self.published:
            if not fut.done():
                fut.set_result(1)


def window(pub: FakePublisher, *, size: int = 3, timeout_s: float = 0.05) -> ChunkWindow:
    return ChunkWindow(
        pub, pub, subject="s", stream="ST", what="the gguf artifact of job j", timeout_s=timeout_s,
        size=size,
    )  # fmt: skip


def chunk(seq: int) -> Chunk:
    return Chunk(seq, b"x", {"seq": str(seq)})


async def test_the_window_holds_at_most_its_size_in_flight() -> None:
    pub = FakePublisher()
    w = window(pub, size=3)
    await w.push(chunk(0))
    await w.push(chunk(1))
    assert pub.seqs() == [0, 1] and len(w.in_flight) == 2
    third = asyncio.create_task(w.push(chunk(2)))
    await asyncio.sleep(0)
    # Full: the push waits for the oldest chunk's acknowledgement.
    assert pub.seqs() == [0, 1, 2] and not third.done()
    pub.published[0][1].set_result(1)
    await third
    assert [c.seq for c in w.in_flight] == [1, 2]


async def test_the_last_chunk_goes_out_only_after_every_other_is_acknowledged() -> None:
    pub = FakePublisher()
    w = window(pub, size=8, timeout_s=5)
    for seq in range(3):
        await w.push(chunk(seq))
    finish = asyncio.create_task(w.finish(chunk(3)))
    await asyncio.sleep(0.01)
    assert pub.seqs() == [0, 1, 2], "the last chunk went out before the others were acked"
    pub.ack_all()
    await asyncio.sleep(0.01)
    assert pub.seqs() == [0, 1, 2, 3]
    pub.ack_all()
    await finish
    assert not w.in_flight


async def test_a_lost_ack_publishes_the_rest_of_the_window_again() -> None:
    pub = FakePublisher()
    w = window(pub, size=8)
    for seq in range(3):
        await w.push(chunk(seq))
    pub.published[2][1].set_result(1)  # chunk 2 made it, 0 and 1 did not
    settling = asyncio.create_task(w.settle(w.in_flight.popleft()))
    await asyncio.sleep(0.08)  # one timeout: 0 again, with 1 (still unacknowledged)
    assert pub.seqs() == [0, 1, 2, 0, 1]
    assert [c.tries for c in w.in_flight] == [2, 1]
    pub.ack_all()
    await settling


async def test_a_chunk_never_acknowledged_fails_after_max_tries() -> None:
    pub = FakePublisher()
    w = window(pub, size=8, timeout_s=0.01)
    await w.push(chunk(0))
    with pytest.raises(DeliveryError, match=f"not acknowledged after {MAX_TRIES} tries"):
        await w.settle(w.in_flight.popleft())
    assert pub.seqs() == [0] * MAX_TRIES


async def test_no_stream_is_published_again_after_a_pause_then_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(delivery, "NO_STREAM_PAUSE_S", 0)
    pub = FakePublisher()
    w = window(pub, size=8, timeout_s=5)
    await w.push(chunk(0))
    await w.push(chunk(1))
    pub.published[1][1].set_exception(NoStreamError("no responders", 503))
    pub.published[0][1].set_exception(NoStreamError("no responders", 503))
    settling = asyncio.create_task(w.settle(w.in_flight.popleft()))
    await _published(pub, 0, 2)
    await _published(pub, 1, 2)
    # Both again: chunk 1 was answered "no responders" too.
    assert pub.seqs() == [0, 1, 0, 1]
    # Patient: on a cluster a stream electing a leader answers so for seconds.
    for left in reversed(range(NO_STREAM_MAX_TRIES - 1)):
        latest = [fut for seq, fut in pub.published if seq == 0][-1]
        latest.set_exception(NoStreamError("no responders", 503))
        if left:  # published again before it is answered (a fixed 2 ms was too short under load)
            await _published(pub, 0, pub.seqs().count(0) + 1)
    with pytest.raises(DeliveryError, match="no JetStream stream took chunk 0 of the gguf"):
        await settling
    assert pub.seqs().count(0) == NO_STREAM_MAX_TRIES
    w.abandon()
    for _, fut in pub.published:  # read, so that asyncio does not report them
        if fut.done() and not fut.cancelled():
            fut.exception()


async def test_a_full_stream_is_refused_at_once_saying_so() -> None:
    pub = FakePublisher()
    w = window(pub)
    await w.push(chunk(0))
    pub.published[0][1].set_exception(PublishRefusedError("maximum bytes exceeded", 400, 10077))
    with pytest.raises(DeliveryError, match="refused chunk 0 of the gguf artifact of job j: the "):
        await w.settle(w.in_flight.popleft())
    assert pub.seqs() == [0]


async def test_a_publish_waits_for_a_reconnecting_connection() -> None:
    pub = FakePublisher(is_connected=False)
    w = window(pub, timeout_s=1)
    publishing = asyncio.create_task(w.publish(chunk(0)))
    await asyncio.sleep(0.1)
    assert pub.seqs() == []
    pub.is_connected = True
    await publishing
    assert pub.seqs() == [0]


async def test_abandon_cancels_what_is_in_flight() -> None:
    pub = FakePublisher()
    w = window(pub, size=8)
    await w.push(chunk(0))
    await w.push(chunk(1))
    pub.published[0][1].set_exception(PublishRefusedError("gone"))
    w.abandon()
    assert not w.in_flight
    assert pub.published[1][1].cancelled()


async def test_the_reader_reads_a_block_ahead_and_splits_it_into_chunks() -> None:
    data = bytes(range(250))
    reads: list[int] = []

    class Counting(io.BytesIO):
        def read(self, n: int | None = -1) -> bytes:
            reads.append(-1 if n is None else n)
            return super().read(n)

    reader = ChunkReader(Counting(data), step=100, count=3, read_chunks=2)
    bodies = [await reader.next_body() for _ in range(3)]
    assert bodies == [data[:100], data[100:200], data[200:]]
    assert reads == [200, 100]  # two chunks at once, then the one left
    assert await reader.next_body() is None
    assert await reader.at_end()
    await reader.close()


async def test_the_window_grows_while_acknowledgements_do_not_queue() -> None:
    w = window(FakePublisher(), size=32)
    assert w.window == delivery.WINDOW_START_CHUNKS
    for seq in range(100):
        w.adapt(chunk(seq), 0.01)
    assert w.window == 32, "a fast link's window is its size"


async def test_the_window_halves_once_per_window_when_chunks_queue() -> None:
    w = window(FakePublisher(), size=32)
    w.window, w.fastest_s = 32, 0.01
    w.in_flight.extend(chunk(seq) for seq in range(10, 41))  # 9 settling, 10..40 in flight
    queued = 0.01 + delivery.QUEUE_TARGET_S + 0.1
    w.adapt(chunk(9), queued)
    assert w.window == 16
    for seq in range(10, 41):  # published before the halving: no second halving for them
        w.adapt(chunk(seq), queued)
    assert w.window == 16
    w.in_flight.extend(chunk(seq) for seq in range(41, 61))
    w.adapt(chunk(41), queued)  # published after it: the queue is still there
    assert w.window == 8
    for seq in range(61, 200):
        w.in_flight.append(chunk(seq))
        w.adapt(chunk(seq), queued)
    assert w.window == 1, "a link that keeps queueing ends at one chunk in flight"


async def test_acknowledgement_times_are_measured_from_publish_to_ack() -> None:
    pub = FakePublisher()
    w = window(pub, size=8, timeout_s=5)
    c = chunk(0)
    await w.push(c)
    await asyncio.sleep(0.05)
    pub.ack_all()
    await asyncio.sleep(0.3)  # settled late: what counts is when the ack came
    await w.settle(w.in_flight.popleft())
    assert 0.04 <= w.fastest_s < 0.25, w.fastest_s


async def _published(pub: FakePublisher, seq: int, count: int, bound_s: float = 10.0) -> None:
    """Until `pub` has published chunk `seq` `count` times (at most `bound_s`)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + bound_s
    while pub.seqs().count(seq) < count:
        assert loop.time() < deadline, f"chunk {seq} published {pub.seqs().count(seq)} times"
        await asyncio.sleep(0.001)
