"""The artifact-store's JetStream I/O against a real nats-server."""

from __future__ import annotations

import hashlib

from nats.aio.client import Client

from lorafleet.artifacts import AsyncPublisher
from lorafleet.names import Names, object_chunk_subject
from lorafleet.objects import WRITE_WINDOW, ObjectWriter
from lorafleet_schemas.messages import ArtifactKind
from lorafleet_services.artifact_store.assembly import Chunk, Key, VerifiedArtifact, object_info
from lorafleet_services.artifact_store.streams import READ_BACK_BATCH, Streams, read_back_batch
from tests.artifacts.conftest import chunks_of, publish
from tests.artifacts.fakes import job

N = Names()
PEFT = ArtifactKind.PEFT
KEY = Key("node-a", "job1", PEFT, 1)
SUBJECT = N.artifact_chunks("node-a", "job1", "peft")


def test_read_back_asks_for_no_more_than_can_lie_up_to_the_bound() -> None:
    assert read_back_batch(0, 1000) == 1  # the first: the delivery may start right there
    assert read_back_batch(10, 1000) == READ_BACK_BATCH
    assert read_back_batch(10, 15) == 5
    assert read_back_batch(15, 15) == 1


async def test_read_back_hands_over_this_deliverys_chunks_up_to_the_sequence(
    nc: Client,
) -> None:
    await publish(nc, job(), PEFT, chunks_of(job(), PEFT, b"a" * 5000, 1000))  # seq 1-5
    await nc.jetstream().publish(SUBJECT, b"not a chunk")  # seq 6: skipped
    # seq 7-8: another attempt on the same subject, skipped.
    await publish(nc, job(attempt=2), PEFT, chunks_of(job(attempt=2), PEFT, b"b" * 2000, 1000))
    streams = Streams(nc.jetstream(), N)
    taken: list[tuple[int, int, bytes]] = []

    async def take(chunk: Chunk, body: bytes, seq: int) -> None:
        assert chunk.key == KEY
        taken.append((seq, chunk.header.seq, body[:1]))

    await streams.read_back(SUBJECT, KEY, 8, take)
    assert [(t[0], t[1]) for t in taken] == [(1, 0), (2, 1), (3, 2), (4, 3), (5, 4)]
    taken.clear()
    await streams.read_back(SUBJECT, KEY, 3, take)
    assert taken == [(1, 0, b"a"), (2, 1, b"a"), (3, 2, b"a")]
    # The read-back consumers are gone.
    assert await nc.jetstream().consumers_info(N.artifacts_stream) == []


async def test_purge_delivery_up_to_a_sequence_or_all(nc: Client) -> None:
    await publish(nc, job(), PEFT, chunks_of(job(), PEFT, b"a" * 5000, 1000))
    streams = Streams(nc.jetstream(), N)
    assert await streams.delivery_subjects() == [SUBJECT]
    await streams.purge_delivery(SUBJECT, 3)
    assert await streams.last_seq(SUBJECT) == 5
    info = await nc.jetstream().stream_info(N.artifacts_stream)
    assert (info.state.messages, info.state.first_seq) == (2, 4)
    await streams.purge_delivery(SUBJECT, 0)
    assert await streams.last_seq(SUBJECT) == 0
    assert await streams.last_message(SUBJECT) is None
    assert await streams.delivery_subjects() == []


async def test_object_chunks_are_written_in_a_window_counted_and_committed(
    nc: Client, publisher: AsyncPublisher
) -> None:
    streams = Streams(nc.jetstream(), N)
    subject = object_chunk_subject(N.artifacts_bucket, "job1.peft.1.w1")
    writer = ObjectWriter(publisher, subject)
    bodies = [bytes([i]) * 100 for i in range(WRITE_WINDOW + 10)]
    for b in bodies:
        await writer.write(b)
    await writer.flush()
    assert (writer.chunks_written, writer.max_chunk) == (len(bodies), 100)
    assert await streams.stored_chunks(subject) == len(bodies)
    data = b"".join(bodies)
    whole = VerifiedArtifact(
        size=len(data), sha256=hashlib.sha256(data).hexdigest(), count=len(bodies)
    )
    info = object_info(N, KEY, whole, chunks=len(bodies), chunk_bytes=100, base_model="tiny",
                       now=job().created_at, nuid="job1.peft.1.w1")  # fmt: skip
    assert await streams.read_info(KEY) is None
    await streams.commit(KEY, info)
    stored = await streams.read_info(KEY)
    assert stored is not None and (stored.size, stored.nuid) == (len(data), "job1.peft.1.w1")
    await streams.purge_object_chunks(subject)
    assert await streams.stored_chunks(subject) == 0
    await writer.settle()  # nothing in flight: returns at once
