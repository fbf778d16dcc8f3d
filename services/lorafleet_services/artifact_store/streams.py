"""The artifact-store's JetStream I/O, and nothing else.

Two streams: the artifacts stream, where a delivery's chunks wait until
their artifact is committed (read back, purged up to a sequence), and the
object store's stream, where an object's chunks are written and its info
message commits it. What to do when is decided in `delivery`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Awaitable, Callable
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RawStreamMsg

from lorafleet.artifacts import ObjectInfo, read_info
from lorafleet.names import (
    ROLLUP_SUBJECT,
    Header,
    Names,
    artifact_object_name,
    object_meta_subject,
    object_stream,
)
from lorafleet.nats._natspy import subject_counts
from lorafleet_services.artifact_store.assembly import Chunk, ChunkError, Key, parse_chunk

#: Most messages asked for at once when reading a delivery back.
READ_BACK_BATCH = 64
#: Seconds one read-back fetch waits; nothing in that time means nothing more is there.
READ_BACK_WAIT_S = 2.0
#: Seconds the server keeps a read-back consumer we failed to delete.
READ_BACK_INACTIVE_S = 30.0
#: Headers of an info message: it replaces the object's earlier ones.
INFO_HEADERS = {Header.ROLLUP: ROLLUP_SUBJECT}

#: What `read_back` hands each chunk of the delivery to: (chunk, body, stream sequence).
Take = Callable[[Chunk, bytes, int], Awaitable[None]]


class CommitError(RuntimeError):
    """The object store does not hold what was just committed (chunks or info)."""


def read_back_batch(seen_seq: int, upto_seq: int) -> int:
    """How many messages to ask for next, having seen up to `seen_seq` (0: none yet).

    No more than can lie at or below `upto_seq`: the stream goes on filling
    meanwhile, and a delivery opened at its first chunk needs that chunk
    alone (a full batch here pulled 12-32 MiB more through the server and
    the store for nothing).
    """
    if not seen_seq:
        return 1
    return max(1, min(READ_BACK_BATCH, upto_seq - seen_seq))


class Streams:
    """The two streams, on one JetStream context."""

    def __init__(self, js: JetStreamContext, names: Names) -> None:
        self.js = js
        self.names = names

    # --- the artifacts stream (deliveries) -------------------------------------

    async def delivery_subjects(self) -> list[str]:
        """Every chunk subject with messages in the artifacts stream, sorted."""
        try:
            subjects = await subject_counts(
                self.js, self.names.artifacts_stream, self.names.artifacts_subjects
            )
        except nats.js.errors.NotFoundError:
            return []
        return sorted(subjects)

    async def last_message(self, subject: str) -> RawStreamMsg | None:
        try:
            return await self.js.get_last_msg(self.names.artifacts_stream, subject)
        except nats.js.errors.NotFoundError:
            return None

    async def last_seq(self, subject: str) -> int:
        """The stream sequence of the newest message on `subject`; 0 when none."""
        last = await self.last_message(subject)
        return 0 if last is None else last.seq or 0

    async def read_back(self, subject: str, key: Key, upto_seq: int, take: Take) -> None:
        """Hand `take` every chunk of `key` on `subject` with a sequence up to `upto_seq`."""
        stream = self.names.artifacts_stream
        sub = await self.js.pull_subscribe(
            subject,
            stream=stream,
            config=ConsumerConfig(
                ack_policy=AckPolicy.NONE,
                deliver_policy=DeliverPolicy.ALL,
                inactive_threshold=READ_BACK_INACTIVE_S,
                mem_storage=True,
            ),
        )
        try:
            await self._feed(sub, key, upto_seq, take)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            with contextlib.suppress(Exception):
                info = await sub.consumer_info()
                await self.js.delete_consumer(stream, info.name)

    async def _feed(
        self, sub: JetStreamContext.PullSubscription, key: Key, upto_seq: int, take: Take
    ) -> None:
        seq = 0
        while True:
            try:
                msgs: list[Msg] = await sub.fetch(
                    read_back_batch(seq, upto_seq), timeout=READ_BACK_WAIT_S
                )
            except TimeoutError:
                return
            for m in msgs:
                seq = m.metadata.sequence.stream
                if seq > upto_seq:
                    return
                try:
                    chunk = parse_chunk(self.names, m.subject, m.headers)
                except ChunkError:
                    continue
                if chunk.key == key:
                    await take(chunk, m.data, seq)
                if seq >= upto_seq or m.metadata.num_pending == 0:
                    return

    async def purge_delivery(self, subject: str, upto_seq: int) -> None:
        """Remove a delivery's chunks, up to and including stream sequence `upto_seq`
        (0: all of them)."""
        kwargs: dict[str, Any] = {"subject": subject}
        if upto_seq:
            kwargs["seq"] = upto_seq + 1
        await self.js.purge_stream(self.names.artifacts_stream, **kwargs)

    # --- the object store's stream -------------------------------------------------

    async def read_info(self, key: Key) -> ObjectInfo | None:
        return await read_info(self.js, self.names, key.job_id, key.kind.value)

    async def stored_chunks(self, chunk_subject: str) -> int:
        """How many object chunks the server holds on `chunk_subject`."""
        info = await self.js.stream_info(
            object_stream(self.names.artifacts_bucket), subjects_filter=chunk_subject
        )
        return int((info.state.subjects or {}).get(chunk_subject, 0))

    async def purge_object_chunks(self, chunk_subject: str) -> None:
        await self.js.purge_stream(
            object_stream(self.names.artifacts_bucket), subject=chunk_subject
        )

    async def commit(self, key: Key, info: dict[str, Any]) -> None:
        """Publish the object's info (the object exists from here on) and read it back."""
        await self.js.publish(
            object_meta_subject(
                self.names.artifacts_bucket, artifact_object_name(key.job_id, key.kind.value)
            ),
            json.dumps(info).encode(),
            headers=dict(INFO_HEADERS),
        )
        check = await self.read_info(key)
        if check is None or (check.size, check.digest, check.nuid) != (
            info["size"],
            info["digest"],
            info["nuid"],
        ):
            raise CommitError(f"{key.label}: the stored object's info does not read back")
