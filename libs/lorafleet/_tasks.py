"""asyncio tasks, written once: stopping them (cancel, and make sure they
ended), a call bounded in time (`within`) and awaiting several a few at a
time (`at_most`).

On Python 3.11 a cancellation can be lost: when it lands just as the
future inside an `asyncio.wait_for` completes, wait_for returns the result
and the task goes on (CPython gh-86296, fixed in 3.12). nats-py wraps every
request in wait_for, so a loop stopped by one `cancel()` could run for good
and its `stop()` hang. `stop_tasks` cancels again until each task has ended;
`within` is asyncio.wait_for made on it. (A CI run: `bus.connect`'s
wait_for over nats.connect, which retries a refused TLS handshake forever,
lost its cancellation and hung its test for three minutes.)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Coroutine, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

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


async def within(timeout_s: float, call: Awaitable[T]) -> T:
    """`call`'s result, or TimeoutError once `timeout_s` has passed and `call`
    has ended (asyncio.wait_for, without the lost cancellation). A call that
    finished as it was being stopped gives its result all the same."""
    task = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        await stop_tasks(task)
        raise
    if not done:
        await stop_tasks(task)
        if task.cancelled() or task.exception() is not None:
            raise TimeoutError(f"not done within {timeout_s:g} s")
    return task.result()


async def at_most(width: int, calls: Sequence[Coroutine[Any, Any, None]]) -> None:
    """Await `calls`, `width` at a time; every one ends before the first
    error is raised (none is left running behind its caller's back)."""
    gate = asyncio.Semaphore(width)

    async def gated(call: Coroutine[Any, Any, None]) -> None:
        async with gate:
            await call

    ended = await asyncio.gather(*(gated(c) for c in calls), return_exceptions=True)
    for error in ended:
        if isinstance(error, BaseException):
            raise error
