"""Stopping asyncio tasks, written once: cancel, and make sure they ended.

On Python 3.11 a cancellation can be lost: when it lands just as the
future inside an `asyncio.wait_for` completes, wait_for returns the result
and the task goes on (CPython gh-86296, fixed in 3.12). nats-py wraps every
request in wait_for, so a loop stopped by one `cancel()` could run for good
and its `stop()` hang. `stop_tasks` cancels again until each task has ended.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

#: Seconds between repeated cancellations of a task that has not ended.
CANCEL_AGAIN_S = 0.2


async def stop_tasks(*tasks: asyncio.Future[Any] | None) -> None:
    """Cancel each task (None and finished ones are skipped) and return once
    all have ended; what they raised while ending is retrieved and dropped."""
    live = {t for t in tasks if t is not None and not t.done()}
    while live:
        for t in live:
            t.cancel()
        _, live = await asyncio.wait(live, timeout=CANCEL_AGAIN_S)
    for ended in tasks:
        if ended is not None and ended.done() and not ended.cancelled():
            with contextlib.suppress(BaseException):
                ended.exception()
