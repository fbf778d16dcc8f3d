"""One KV watch that lasts: `KeyWatch` re-watches after a failure or a reconnect.

nats-py's `KeyValue.watch` ends with its subscription; the scheduler wants
every key's last value again after a reconnect, and tries again after a
failure with stamina's back-off. Every fresh watch delivers each key's last
value first, then `None`, then every change. With `probe_s` it also knows
whether it can see at all (the nodes bucket): a failed probe, a copy behind
the leader (`behind`), a consumer that sent nothing while the leader held
more (`stalled`), or initial values not delivered yet, is blindness
(`on_view(False)`, then `on_view(True)`); a watch blind for
`REBUILD_AFTER_S` is rebuilt. Why each: scheduler/DESIGN.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

import stamina
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from lorafleet._tasks import stop_tasks
from lorafleet.log import Event
from lorafleet.names import KV_DEL, KV_PURGE, kv_stream
from lorafleet.nats._natspy import watch_consumer_info

#: Seconds before the first retry of a failed watch; default 0.5.
WATCH_RETRY_S = 0.5
#: Seconds the back-off between failed watches grows to at most: well under
#: any node timeout, so the node table catches up soon after the server does.
WATCH_RETRY_MAX_S = 1.0
#: Seconds one health probe (consumer info, stream info) may take.
HEALTH_PROBE_TIMEOUT_S = 0.5
#: Probes in a row that find the consumer sending nothing it has before the
#: watch counts as blind (one could fall between an entry's store and its send).
STALLED_PROBES = 2
#: Seconds of blindness after which the watch is rebuilt (a fresh consumer):
#: well inside a 3 s node timeout, and not so often that a server still
#: electing is asked for a new consumer every probe.
REBUILD_AFTER_S = 1.5


def behind(consumer: Any, stream: Any) -> str | None:
    """Why the copy of the stream the watch's consumer reads is behind its
    leader (None: it is not, or either info lacks the cluster's view). A
    member back from a cut catches up for seconds, its consumers delivering
    nothing new while they answer (pinned by tests/scheduler/test_nodes.py)."""
    host = consumer.cluster.leader if consumer.cluster is not None else None
    if stream.cluster is None or not host or host == stream.cluster.leader:
        return None
    for replica in stream.cluster.replicas or []:
        if replica.name == host and not replica.current:
            return f"the copy its consumer reads ({host}) is behind the bucket's leader"
    return None


class KeyWatch:
    """Watch `keys` of KV `bucket` until stopped, handing each entry (and the
    `None` that ends the initial values) to `on_entry`.

    probe_s: seconds between health probes; None (the default): no probes.
    on_view: told False when the watch goes blind, True when it sees again.
    clock: monotonic seconds.
    """

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        keys: str,
        on_entry: Callable[[KeyValue.Entry | None], None],
        logger: Any,
        *,
        probe_s: float | None = None,
        on_view: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.keys = keys
        self.on_entry = on_entry
        self.logger = logger
        self.probe_s = probe_s
        self.on_view = on_view
        self.clock = clock
        self._task: asyncio.Task[None] | None = None
        self._probe_task: asyncio.Task[None] | None = None
        self._watcher: Any = None
        #: The current watch has delivered every key's last value.
        self._initial_done = False
        #: None: never seen yet; else whether the last probe could see.
        self.seeing: bool | None = None
        self._blind_since = 0.0
        self._built_at = 0.0
        #: clock() of the last entry delivered (a watch still delivering lives).
        self._entry_at = 0.0
        #: How many times a blind watch was rebuilt (tests and benches read it).
        self.rebuilds = 0
        #: What the last probes saw the consumer send: its delivered stream
        #: sequence, and how many probes in a row it sent nothing it had.
        self._delivered = -1
        self._unsent_probes = 0

    def start(self) -> None:
        self._built_at = self.clock()
        self._delivered, self._unsent_probes = -1, 0
        self._task = asyncio.create_task(self._run())
        if self.probe_s is not None and self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop(self.probe_s))

    def restart(self) -> None:
        """Start over now with a fresh watch (after a reconnect), cutting
        short any back-off in progress."""
        if self._task is not None:
            self._task.cancel()
        self.start()

    async def stop(self) -> None:
        await stop_tasks(self._probe_task, self._task)
        self._task = self._probe_task = None

    def _retry(self, error: BaseException) -> bool:
        # stamina asks about every exception, cancellation included: a
        # cancelled watch (stop, restart, or nats-py cancelling a pending
        # request as its connection closes) must end, not back off.
        if not isinstance(error, Exception):
            return False
        self.logger.warning(Event.NATS_ERROR, message=f"watching {self.bucket}", error=repr(error))
        return True

    async def _run(self) -> None:
        while True:
            # A watch that ends without an error (its subscription went away)
            # is followed at once by a fresh one; only failures back off.
            async for attempt in stamina.retry_context(
                on=self._retry,
                attempts=None,
                timeout=None,
                wait_initial=WATCH_RETRY_S,
                wait_max=WATCH_RETRY_MAX_S,
                wait_jitter=0.0,
            ):
                with attempt:
                    await self._watch_once()

    async def _watch_once(self) -> None:
        self._initial_done = False
        kv = await self.js.key_value(self.bucket)
        watcher = await kv.watch(self.keys)
        self._watcher = watcher
        try:
            async for entry in watcher:
                self._entry_at = self.clock()
                if entry is None:
                    self._initial_done = True
                self.on_entry(entry)
        finally:
            self._watcher = None
            self._initial_done = False
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]

    # --- health -----------------------------------------------------------

    async def probe(self) -> str | None:
        """Why the watch cannot see now (None: it can)."""
        watcher = self._watcher
        if watcher is None or not self._initial_done:
            return "the watch has not delivered the bucket's content yet"
        try:
            consumer = await watch_consumer_info(watcher, HEALTH_PROBE_TIMEOUT_S)
        except Exception as e:
            return f"its consumer does not answer: {e!r}"
        try:
            stream = await asyncio.wait_for(
                self.js.stream_info(kv_stream(self.bucket)), HEALTH_PROBE_TIMEOUT_S
            )
        except Exception as e:
            return f"the bucket's stream does not answer: {e!r}"
        return behind(consumer, stream) or self.stalled(consumer, stream)

    def stalled(self, consumer: Any, stream: Any) -> str | None:
        """Why the consumer stopped sending (None: it did not). After a
        member's restart a consumer may answer its info and send nothing
        until nats-py gives it up (two missed 5 s idle heartbeats). Blind once
        STALLED_PROBES probes in a row saw the leader hold entries past what
        the consumer had sent, and it sent nothing new between them
        (tests/scheduler/test_nodes.py pins it)."""
        delivered = consumer.delivered.stream_seq if consumer.delivered is not None else 0
        last = stream.state.last_seq if stream.state is not None else 0
        unsent = delivered == self._delivered and last > (delivered or 0)
        self._delivered = delivered
        self._unsent_probes = self._unsent_probes + 1 if unsent else 0
        if self._unsent_probes < STALLED_PROBES:
            return None
        return f"its consumer sent nothing since the last probe (entry {delivered} of {last})"

    async def _probe_loop(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            self.judge(await self.probe())

    def judge(self, blind_because: str | None) -> None:
        """One probe's verdict: report a change of view; rebuild a watch blind too long."""
        now = self.clock()
        seeing, was = blind_because is None, self.seeing
        if seeing != was:
            self.seeing = seeing
            if seeing and was is False:
                blind_s = round(now - self._blind_since, 3)
                self.logger.info(Event.WATCH_RESTORED, message=self.bucket, blind_s=blind_s)
            elif not seeing:
                self._blind_since = now
                self.logger.warning(Event.WATCH_BLIND, message=f"{self.bucket}: {blind_because}")
            if self.on_view is not None:
                self.on_view(seeing)
        quiet_s = now - max(self._built_at, self._entry_at)
        if not seeing and quiet_s >= REBUILD_AFTER_S:
            # The consumer may live on a dead server: ask for a fresh one (not
            # while entries still arrive: a big bucket's content takes a while).
            self.rebuilds += 1
            self.restart()


def removed(operation: str | None) -> bool:
    """Whether a KV entry's operation removes its key: a delete, or the purge
    marker an expired key leaves (a node's heartbeat: the scheduler's
    `nodes.departure` tells the two apart; the gateway needs only this)."""
    return operation in (KV_DEL, KV_PURGE)
