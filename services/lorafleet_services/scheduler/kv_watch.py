"""One KV watch that lasts: `KeyWatch` re-watches after a failure or a reconnect.

nats-py's `KeyValue.watch` ends with its subscription; after the
connection came back the scheduler wants every key's last value again (its
view of the nodes and the leader key may have missed changes), and after a
failure (JetStream not ready yet after a server restart, a timeout) it
tries again with stamina's back-off. Every fresh watch delivers each key's
last value first, then `None`, then every change.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import stamina
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from lorafleet._tasks import stop_tasks
from lorafleet.log import Event

#: Seconds before the first retry of a failed watch; default 0.5.
WATCH_RETRY_S = 0.5
#: Seconds the back-off between failed watches grows to at most: well under
#: any node timeout, so the node table catches up soon after the server does.
WATCH_RETRY_MAX_S = 1.0


class KeyWatch:
    """Watch `keys` of KV `bucket` until stopped, handing each entry (and the
    `None` that ends the initial values) to `on_entry`."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        keys: str,
        on_entry: Callable[[KeyValue.Entry | None], None],
        logger: Any,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.keys = keys
        self.on_entry = on_entry
        self.logger = logger
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def restart(self) -> None:
        """Start over now with a fresh watch (after a reconnect), cutting
        short any back-off in progress."""
        if self._task is not None:
            self._task.cancel()
        self.start()

    async def stop(self) -> None:
        if self._task is None:
            return
        await stop_tasks(self._task)
        self._task = None

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
        kv = await self.js.key_value(self.bucket)
        watcher = await kv.watch(self.keys)
        try:
            async for entry in watcher:
                self.on_entry(entry)
        finally:
            with contextlib.suppress(Exception):
                await watcher.stop()  # type: ignore[no-untyped-call]
