"""One way for a test to wait for something: `eventually()`.

Tests poll real processes (a job reaching a state, a server's log line, a
file appearing). Each of those waits is bounded in time, polls at a fixed
pace, and says on failure what it waited for and what it saw last — written
once here (temporal's `assert_eventually`), not as a loop in every file.

    job = await eventually(lambda: client.get(job_id), "job done",
                           until=lambda j: j.state is JobState.DONE)

`check` may be a plain or an async callable. Without `until`, a truthy
result ends the wait; with it, `until(result)` decides. An exception from
`check` counts as "not yet" only when it is one of `retry_on`.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

#: Seconds a wait lasts unless told otherwise.
DEFAULT_TIMEOUT_S = 30.0
#: Seconds between two checks.
DEFAULT_INTERVAL_S = 0.05


class NeverHappenedError(AssertionError):
    """What a test waited for did not happen in time (an AssertionError, so
    pytest reports it as a failed assertion)."""


async def eventually(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    *,
    until: Callable[[T], object] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Call `check` until its result is accepted; return that result.

    timeout_s: seconds before NeverHappenedError; default 30.
    interval_s: seconds between checks; default 0.05.
    retry_on: exception types that mean "not yet" (others propagate).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    last: Any = None
    last_error: BaseException | None = None
    while True:
        try:
            result = check()
            if inspect.isawaitable(result):
                result = await result
            last, last_error = result, None
            if until(result) if until is not None else result:
                return result  # type: ignore[return-value]
        except retry_on as e:
            last_error = e
        if loop.time() >= deadline:
            seen = f"last error {last_error!r}" if last_error is not None else f"last saw {last!r}"
            raise NeverHappenedError(f"timed out after {timeout_s:g} s waiting for {what}; {seen}")
        await asyncio.sleep(interval_s)
