"""Which scheduler replica leads: a lease on one key, renewed by compare-and-set.

The key `scheduler` of KV `<prefix>_leader` holds the leader's instance id,
published with `Nats-Expected-Last-Subject-Sequence` and a per-message TTL
of `bus.LEADER_TTL_S`, renewed every `LEADER_RENEW_S` against its own last
revision. A replica counts itself leader only until `LEADER_TTL_S -
LEADER_SAFETY_S` after the start of its last successful publish, so two
replicas never both act. nats-py's `kv.create` cannot be used: it does not
recognise the server's expiry marker as a deleted key, and `kv.update`
takes no TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from lorafleet._tasks import stop_tasks
from lorafleet.log import Event
from lorafleet.names import KV_DEL, KV_PURGE, Header, Names, kv_stream
from lorafleet.nats._bus import LEADER_TTL_S
from lorafleet.nats._kv_watch import KeyWatch

#: Seconds between renewals of the leader key (its TTL is bus.LEADER_TTL_S).
LEADER_RENEW_S = 1.0
#: The leader stops acting this many seconds before its key could have
#: expired without a renewal, so two leaders never act at once.
LEADER_SAFETY_S = 0.5
#: The key in the leader bucket.
LEADER_KEY = "scheduler"
#: JetStream's error codes for a wrong expected last subject sequence.
_WRONG_LAST_SEQUENCE = (10071, 10164)


class Leadership:
    """This replica's part in the election, on an open JetStream context.

    instance: the id written into the key. clock: monotonic seconds
    (injected for tests); default time.monotonic. on_acquired: called each
    time this replica becomes leader.
    """

    def __init__(
        self,
        js: JetStreamContext,
        names: Names,
        instance: str,
        logger: Any,
        clock: Callable[[], float] = time.monotonic,
        on_acquired: Callable[[], None] = lambda: None,
    ) -> None:
        self.js = js
        self.names = names
        self.instance = instance
        self.logger = logger
        self.clock = clock
        self.on_acquired = on_acquired
        #: The key's revision as this replica last wrote it.
        self.revision = 0
        #: Monotonic seconds until which this replica may act as leader.
        self.lease_until = 0.0
        #: Monotonic seconds when this replica's newest successful write of the
        #: key began: it reached the cluster's majority then (0: never). A
        #: member cut off from the others still answers reads, as leader of
        #: its streams, for many seconds; only a write needs the majority
        #: (tests/nemesis/test_found_on_a_cluster.py).
        self.majority_at = 0.0
        self._subject = names.kv_subject(names.leader_bucket, LEADER_KEY)
        self._changed = asyncio.Event()
        self._watch = KeyWatch(js, names.leader_bucket, LEADER_KEY, self._on_entry, logger)
        self._task: asyncio.Task[None] | None = None

    def is_leader(self) -> bool:
        return self.clock() < self.lease_until

    def start(self) -> None:
        self._watch.start()
        self._task = asyncio.create_task(self._run())

    def restart_watch(self) -> None:
        """After a reconnect: read the key afresh (a delete may have been missed)."""
        self._watch.restart()

    async def stop(self) -> None:
        """Stop campaigning and, when leading, resign: delete the key so
        another replica takes over at once rather than after the TTL."""
        await stop_tasks(self._task)
        await self._watch.stop()
        await self.resign()

    async def resign(self) -> None:
        if self.is_leader():
            with contextlib.suppress(Exception):
                kv = await self.js.key_value(self.names.leader_bucket)
                await kv.delete(LEADER_KEY, last=self.revision)
        self.lease_until = 0.0

    async def _run(self) -> None:
        while True:
            await self.step()
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), LEADER_RENEW_S)

    def _on_entry(self, entry: KeyValue.Entry | None) -> None:
        if entry is not None and entry.operation in (KV_PURGE, KV_DEL):
            self._changed.set()

    async def step(self) -> None:
        """One move: renew the lease when holding one, else try to take the key."""
        was = self.is_leader()
        try:
            if self.lease_until > 0:
                await self._renew()
            else:
                await self._acquire()
        except Exception as e:
            if self.lease_until > 0:
                self.lease_until = 0.0
                self.logger.warning(Event.LEADER_LOST, error=repr(e))
            else:
                self.logger.debug(Event.NATS_ERROR, message="leader election", error=repr(e))
        if self.is_leader() and not was:
            self.on_acquired()

    async def _acquire(self) -> None:
        last = 0
        try:
            current = await self.js.get_msg(
                kv_stream(self.names.leader_bucket), subject=self._subject
            )
        except nats.js.errors.NotFoundError:
            pass
        else:
            headers = current.headers or {}
            deleted = Header.KV_OPERATION in headers or Header.MARKER_REASON in headers
            if not deleted and current.data != self.instance.encode():
                return  # someone else leads
            last = current.seq or 0
        if await self._publish(last):
            self.logger.info(Event.LEADER_ACQUIRED, message=self.instance)

    async def _renew(self) -> None:
        if not await self._publish(self.revision):
            self.lease_until = 0.0
            self.logger.warning(Event.LEADER_LOST, message="another scheduler holds the key")

    async def _publish(self, last: int) -> bool:
        """Write the key if its last revision is still `last`; False when
        another replica wrote it first."""
        started = self.clock()
        try:
            ack = await self.js.publish(
                self._subject,
                self.instance.encode(),
                headers={Header.EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)},
                msg_ttl=LEADER_TTL_S,
            )
        except nats.js.errors.APIError as e:
            if e.err_code in _WRONG_LAST_SEQUENCE:
                return False
            raise
        self.revision = ack.seq
        self.majority_at = started
        self.lease_until = started + LEADER_TTL_S - LEADER_SAFETY_S
        return True
