"""One bucket's retention sweep, written once: the artifact-store runs it
over the artifacts bucket, the recorder over the datasets bucket, each
every `Settings.retention_sweep_every_s` and for `lorafleet gc`.

The order of each run, and why:

1. The bucket's objects are listed, each with its info message's sequence.
2. The owner judges them (`Judge`): reads who references what now (after
   the listing, so an object stored since is not judged at all) and says
   which objects are unneeded and why (`rules`).
3. An unneeded object is removed only once it was found unneeded, with the
   same info sequence, `grace_s` ago or more (`marks`, this process's
   memory: a restart only delays removals). A reference on its way when
   the references were read (a submit naming a file being deleted) lands
   within that time and is seen by a later run.
4. The owner has its last word (`before_remove`: the artifact-store has
   the recorder forget the reference, which it refuses while the job is
   not final, checked in its own transaction).
5. The removal is a compare-and-set on the info's sequence
   (`lorafleet.objects.remove_object`): whoever makes a new reference to a
   stored object touches it first, so an object touched since the listing
   is left alone. A removal done twice (two replicas, a retry) does nothing
   the second time: idempotent.

Every removal is logged (`retention.removed`, with bucket, object, kind,
size, reason, job); each run ends with `retention.swept`.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import nats.errors
from nats.js import JetStreamContext

from lorafleet import log
from lorafleet.errors import ApiError
from lorafleet.log import Event
from lorafleet.objects import ListedObject, listed_objects, remove_object
from lorafleet.retention.rules import Policy, duration
from lorafleet_schemas.messages import GcItem, GcReport


@dataclass(frozen=True)
class Unneeded:
    """An object a judge let go, and why."""

    obj: ListedObject
    kind: str
    reason: str
    job_id: str | None = None


@dataclass
class Judgement:
    unneeded: list[Unneeded] = field(default_factory=list)
    #: Why nothing at all may be removed this run (rules.refusal).
    refused: str = ""


Judge = Callable[[Sequence[ListedObject]], Awaitable[Judgement]]
#: The owner's last word before a removal (the artifact-store: the recorder
#: forgets the reference, refusing while the job is not final); False keeps it.
BeforeRemove = Callable[[Unneeded], Awaitable[bool]]
Clock = Callable[[], dt.datetime]


def wall_now() -> dt.datetime:
    """The wall clock, in UTC (the rules compare it with the recorder's times)."""
    return dt.datetime.now(dt.UTC)


def due(
    unneeded: Sequence[Unneeded],
    marks: dict[tuple[str, int], dt.datetime],
    now: dt.datetime,
    grace_s: float,
) -> tuple[list[Unneeded], list[Unneeded], dict[tuple[str, int], dt.datetime]]:
    """(removable now, waiting for the grace, the marks to keep): an object
    is removable once unneeded, with the same info sequence, for `grace_s`."""
    kept: dict[tuple[str, int], dt.datetime] = {}
    ready: list[Unneeded] = []
    waiting: list[Unneeded] = []
    for u in unneeded:
        key = (u.obj.name, u.obj.seq)
        since = kept[key] = marks.get(key, now)
        (ready if (now - since).total_seconds() >= grace_s else waiting).append(u)
    return ready, waiting, kept


class RetentionSweep:
    """Retention of one bucket: `run(dry_run)`, one at a time."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        judge: Judge,
        policy: Policy,
        *,
        clock: Clock = wall_now,
        before_remove: BeforeRemove | None = None,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.judge = judge
        self.policy = policy
        self.clock = clock
        self.before_remove = before_remove
        #: (object, info sequence) -> when a run first found it unneeded.
        self.marks: dict[tuple[str, int], dt.datetime] = {}
        self._lock = asyncio.Lock()
        self.logger = log.get()

    def _item(self, u: Unneeded) -> GcItem:
        return GcItem(
            bucket=self.bucket, object=u.obj.name, kind=u.kind, size=u.obj.size,
            reason=u.reason, job_id=u.job_id,
        )  # fmt: skip

    async def run(self, dry_run: bool = False) -> GcReport:
        """One sweep (a dry run removes nothing and leaves the marks as they are)."""
        async with self._lock:
            objects = await listed_objects(self.js, self.bucket)
            judged = await self.judge(objects)
            report = GcReport(dry_run=dry_run, examined=len(objects), refused=judged.refused)
            if judged.refused:
                self.logger.warning(Event.RETENTION_REFUSED, bucket=self.bucket,
                                    error=judged.refused)  # fmt: skip
                return report
            ready, waiting, marks = due(
                judged.unneeded, self.marks, self.clock(), self.policy.grace_s
            )
            report.waiting = [self._item(u) for u in waiting]
            if dry_run:
                report.removed = [self._item(u) for u in ready]
            else:
                self.marks = marks
                for u in ready:
                    if await self._remove(u):
                        report.removed.append(self._item(u))
            report.freed_bytes = sum(i.size for i in report.removed)
            self.logger.info(
                Event.RETENTION_SWEPT, bucket=self.bucket, dry_run=dry_run,
                examined=report.examined, removed=len(report.removed),
                freed_bytes=report.freed_bytes, waiting=len(waiting),
                grace=duration(self.policy.grace_s),
            )  # fmt: skip
            return report

    async def _remove(self, u: Unneeded) -> bool:
        try:
            if self.before_remove is not None and not await self.before_remove(u):
                self.marks.pop((u.obj.name, u.obj.seq), None)
                return False
            removed = await remove_object(self.js, self.bucket, u.obj)
        except (ApiError, nats.errors.Error, OSError, TimeoutError) as e:
            self.logger.warning(Event.NATS_ERROR, bucket=self.bucket, object=u.obj.name,
                                error=f"removing: {e!r}")  # fmt: skip
            return False
        self.marks.pop((u.obj.name, u.obj.seq), None)
        if removed:
            self.logger.info(
                Event.RETENTION_REMOVED, bucket=self.bucket, object=u.obj.name, kind=u.kind,
                size=u.obj.size, reason=u.reason, job_id=u.job_id,
            )  # fmt: skip
        return removed

    async def every(self, every_s: float) -> None:
        """Run a sweep every `every_s` (the first after `every_s`), for ever;
        a failed one is logged and the next tried at its time."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.run()
            except (ApiError, nats.errors.Error, OSError, TimeoutError) as e:
                self.logger.warning(Event.NATS_ERROR, bucket=self.bucket,
                                    error=f"retention sweep: {e!r}")  # fmt: skip
            except Exception as e:  # a bug in one run must not end the sweeps
                self.logger.exception(Event.RETENTION_REFUSED, bucket=self.bucket,
                                      error=f"retention sweep failed: {e!r}")  # fmt: skip
