"""What the artifact-store cleans up that no chunk will ever come for.

- Orphans: object chunks a store wrote and never committed because it died
  (its deliveries are read back and rewritten, under a new nuid, by the
  next store). No object's info refers to them and no live assembly writes
  them; they are purged once their newest chunk is `orphan_age_s` old (a
  live replica's are written to more often than that). One sweep runs at
  start, then one every SWEEP_EVERY_S.
- Idle deliveries: an agent that died mid-delivery leaves one open. After
  `idle_check_s` without a chunk it is checked again: committed by a
  replica, for a job that no longer takes it, or a checkpoint older than
  the one stored, it is discarded.

A job's stored checkpoint is committed (its info refers to its chunks), so
no sweep takes it, whatever the job's state: a failed job keeps its newest
checkpoint for a resume.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterable

import nats.errors
import nats.js.errors

from lorafleet import log
from lorafleet.artifacts import ObjectInfo, decode_info
from lorafleet.log import Event
from lorafleet.names import (
    Names,
    object_chunk_subject,
    object_chunk_subjects,
    object_meta_subjects,
    object_stream,
)
from lorafleet.nats._natspy import subject_counts, subjects_at
from lorafleet_services.artifact_store.assembly import (
    delivery_refusal_reason,
    is_stored,
    superseded,
)
from lorafleet_services.artifact_store.delivery import Deliveries, RecorderRequests, idle

#: Seconds without a new chunk after which an open delivery's job is checked
#: again (an agent that died mid-delivery leaves one; its job is failed elsewhere).
IDLE_CHECK_S = 60.0
#: Seconds between sweeps for such leftovers (one also runs at start).
SWEEP_EVERY_S = 300.0


# --- decisions -----------------------------------------------------------------


def committed_chunks(names: Names, infos: Iterable[ObjectInfo | None]) -> set[str]:
    """The chunk subjects that the objects' info messages refer to (deleted ones excepted)."""
    return {
        object_chunk_subject(names.artifacts_bucket, info.nuid)
        for info in infos
        if info is not None and not info.deleted
    }


def wall_now() -> dt.datetime:
    """This host's clock: the ages' fallback where the server gives no time."""
    return dt.datetime.now(dt.UTC)


def age_s(now: dt.datetime, newest: dt.datetime | None) -> float:
    """Seconds since a subject's newest message (0 when the server gave no time)."""
    return (now - newest).total_seconds() if newest else 0.0


def orphans(
    ages_s: dict[str, float], committed: set[str], writing: set[str], *, min_age_s: float
) -> list[str]:
    """Object chunk subjects no object refers to, no assembly here writes, idle `min_age_s`.

    `ages_s` maps each chunk subject to the age of its newest message
    (seconds). A store that died mid-write leaves such subjects; a live
    replica's are still being written to (hence the age).
    """
    return sorted(
        subj
        for subj, age in ages_s.items()
        if subj not in committed and subj not in writing and age >= min_age_s
    )


def sweep_due(now: float, last_sweep: float, every_s: float = SWEEP_EVERY_S) -> bool:
    return now - last_sweep > every_s


# --- the I/O ----------------------------------------------------------------------


class Sweeper:
    """Sweeps for orphans and gives up idle deliveries of `deliveries`.

    orphan_age_s: seconds after its newest chunk that an object chunk subject
    no object refers to is taken for a dead store's leftovers
    (`Settings.artifact_orphan_age_s`: 600, fault tests use 0).
    idle_check_s: see IDLE_CHECK_S.
    clock: seconds, monotonic (the event loop's time in the service).
    """

    def __init__(
        self,
        deliveries: Deliveries,
        recorder: RecorderRequests,
        clock: Callable[[], float],
        *,
        orphan_age_s: float,
        idle_check_s: float = IDLE_CHECK_S,
    ) -> None:
        self.deliveries = deliveries
        self.streams = deliveries.streams
        self.names = deliveries.names
        self.recorder = recorder
        self.clock = clock
        self.orphan_age_s = orphan_age_s
        self.idle_check_s = idle_check_s
        self.logger = log.get()
        self.last_sweep = 0.0

    async def tick(self) -> None:
        """What the consumer loop runs between batches (and when none come)."""
        await self.check_idle()
        if sweep_due(self.clock(), self.last_sweep):
            await self.sweep()

    async def check_idle(self) -> None:
        """Give up deliveries that stopped coming for a job that no longer takes them."""
        now = self.clock()
        for d in idle(self.deliveries.open.values(), now, self.idle_check_s):
            d.touched = now
            key = d.key
            try:
                info = await self.streams.read_info(key)
                if is_stored(info, key):
                    # Another store (a replica) committed it.
                    await self.deliveries.discard(d)
                    continue
                if key.is_checkpoint and superseded(info, key) is not None:
                    # A checkpoint the agent stopped sending (its delivery
                    # failed); a newer one is stored, so none will finish it.
                    await self.deliveries.discard(d)
                    continue
                why = delivery_refusal_reason(await self.recorder.get_job(key.job_id), key)
                if why is not None:
                    self.logger.warning(Event.ARTIFACT_REJECTED, job_id=key.job_id,
                                        node=key.node, kind=key.kind.value,
                                        error=f"gave up an unfinished delivery: {why}")  # fmt: skip
                    await self.deliveries.discard(d)
            except Exception as e:
                self.logger.warning(Event.NATS_ERROR, job_id=key.job_id, error=repr(e))

    async def sweep(self) -> None:
        """Purge object chunks that a store which died mid-write left behind."""
        self.last_sweep = self.clock()
        try:
            for subject in await self._orphans():
                self.logger.info(Event.ARTIFACT_REJECTED, error=f"purged leftover {subject}")
                await self.streams.purge_object_chunks(subject)
        except nats.js.errors.NotFoundError:
            return
        except nats.errors.Error as e:
            self.logger.warning(Event.NATS_ERROR, error=f"sweeping leftovers: {e!r}")

    async def _orphans(self) -> list[str]:
        js = self.streams.js
        bucket = self.names.artifacts_bucket
        stream = object_stream(bucket)
        chunks, server_now = await subjects_at(js, stream, object_chunk_subjects(bucket))
        metas = await subject_counts(js, stream, object_meta_subjects(bucket))
        infos = []
        for subject in metas:
            raw = await js.get_last_msg(stream, subject)
            infos.append(decode_info(raw.data or b""))
        committed = committed_chunks(self.names, infos)
        writing = self.deliveries.writing()
        ages: dict[str, float] = {}
        # Ages on the server's clock, which stamped the chunks: a store host's
        # clock an hour ahead would take a replica's delivery in progress
        # for a dead store's leftovers (its own are in `writing`).
        now = server_now or wall_now()
        for subject in chunks:
            if subject in committed or subject in writing:
                continue
            raw = await js.get_last_msg(stream, subject)
            ages[subject] = age_s(now, raw.time)
        return orphans(ages, committed, writing, min_age_s=self.orphan_age_s)
