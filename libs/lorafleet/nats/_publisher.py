"""Messages published in the order they were queued, each until acknowledged.

`put()` only queues: the caller (a trainer's stdout relay, an adapter load)
never waits on NATS. One task publishes the queue in order, each message a
JetStream publish awaited for its ack and retried on failure (stamina,
RETRY_FIRST_S doubling to RETRY_MAX_S) under its message id, so a retry is
stored once; a message still refused after `give_up_s` seconds is dropped
(`on_dropped`) and the next one goes (None: retried until stopped). The
agent's status reports and serving reports both go out through one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import stamina
from nats.js import JetStreamContext

from lorafleet.names import Header

#: Seconds one publish waits for its ack before it is retried.
PUBLISH_TIMEOUT_S = 2.0
#: First and longest pause between two tries of one message; seconds.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message to publish: where, what, and the id that makes a retry
    a duplicate (`lorafleet.names`' message id builders)."""

    subject: str
    payload: bytes
    msg_id: str
    #: The sender's sequence number, for the logs.
    seq: int = 0


def _ignore(_msg: Outgoing, _error: Exception) -> None:
    return None


class OrderedPublisher:
    """Publishes what `put` queues, in order, each until acknowledged.

    give_up_s: seconds one message is retried for before it is dropped;
    None (the default) retries it until `stop` or `abandon`.
    on_retry(msg, error): after each failed try. on_dropped(msg, error):
    when `give_up_s` runs out for `msg`.
    """

    def __init__(
        self,
        js: JetStreamContext,
        *,
        name: str,
        give_up_s: float | None = None,
        on_retry: Callable[[Outgoing, Exception], None] = _ignore,
        on_dropped: Callable[[Outgoing, Exception], None] = _ignore,
        publish_timeout_s: float = PUBLISH_TIMEOUT_S,
    ) -> None:
        self.js = js
        self.name = name
        self.give_up_s = give_up_s
        self.on_retry = on_retry
        self.on_dropped = on_dropped
        self.publish_timeout_s = publish_timeout_s
        #: Messages acknowledged, and dropped after `give_up_s`, so far.
        self.published = 0
        self.dropped = 0
        self._queued = 0
        self._queue: asyncio.Queue[Outgoing | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False

    @property
    def unpublished(self) -> int:
        """Messages queued and neither acknowledged nor dropped yet."""
        return self._queued - self.published - self.dropped

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._publish_all(), name=self.name)

    def put(self, msg: Outgoing) -> None:
        self._queued += 1
        self._queue.put_nowait(msg)

    async def stop(self, timeout_s: float | None = None) -> int:
        """Publish what is queued, for at most `timeout_s` seconds (None:
        until done), then stop; how many this left unpublished."""
        task = self._task
        if task is not None and not task.done():
            self._queue.put_nowait(None)
            await asyncio.wait({task}, timeout=timeout_s)
        return self.abandon()

    def abandon(self) -> int:
        """Stop now, dropping what is not published; how many this dropped
        (0 when it had stopped already: each loss is counted once)."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
        if self._stopped:
            return 0
        self._stopped = True
        return self.unpublished

    async def _publish_all(self) -> None:
        while (msg := await self._queue.get()) is not None:
            try:
                await self._publish(msg)
            except Exception as e:  # given up: `give_up_s` ran out
                self.dropped += 1
                self.on_dropped(msg, e)
            else:
                self.published += 1

    async def _publish(self, msg: Outgoing) -> None:
        headers = {Header.MSG_ID: msg.msg_id}
        async for attempt in stamina.retry_context(
            on=Exception,
            attempts=None,
            timeout=self.give_up_s,
            wait_initial=RETRY_FIRST_S,
            wait_max=RETRY_MAX_S,
            wait_jitter=0,
        ):
            with attempt:
                try:
                    await self.js.publish(
                        msg.subject, msg.payload, timeout=self.publish_timeout_s, headers=headers
                    )
                except Exception as e:
                    self.on_retry(msg, e)
                    raise
