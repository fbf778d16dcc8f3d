"""Polling until something is ready, written once: a check repeated at a
fixed pace under a time bound and, where a check is itself slow or costly,
a count bound too.

    if not await poll_until(cluster_ready, timeout_s=30, interval_s=0.1):
        raise NatsServerError("the cluster did not become ready within 30 s ...")

`poll_until` is for coroutines, `poll_until_sync` for code that holds no
event loop (vLLM's start, `local.vllm_launch`); both answer whether `check` said
yes, so the caller raises its own error, naming what it waited for. An
exception from `check` propagates (a process that died while starting is
not "not yet"). The tests' own waits are tests/eventually.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable


class Pace:
    """The bound on one poll: `timeout_s` seconds, and at most `max_tries`
    checks when given (None: as many as fit in the time), `interval_s`
    seconds apart. `clock` is injectable for tests; default time.monotonic."""

    def __init__(
        self,
        timeout_s: float,
        interval_s: float,
        max_tries: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_tries is not None and max_tries < 1:
            raise ValueError(f"max_tries is {max_tries}; give at least 1, or None for no count")
        self.interval_s = interval_s
        self.max_tries = max_tries
        self.clock = clock
        self.deadline = clock() + timeout_s
        self.tries = 0

    def next_pause_s(self) -> float | None:
        """Count the check just made; answer the seconds to sleep before the
        next one, or None when the bound is spent (no further check)."""
        self.tries += 1
        remaining_s = self.deadline - self.clock()
        if remaining_s <= 0 or (self.max_tries is not None and self.tries >= self.max_tries):
            return None
        # The last pause ends at the deadline, so the final check is made there.
        return min(self.interval_s, remaining_s)


async def poll_until(
    check: Callable[[], Awaitable[bool]],
    *,
    timeout_s: float,
    interval_s: float,
    max_tries: int | None = None,
) -> bool:
    """Await `check()` until it is true (answers True) or the bound is spent
    (answers False): `timeout_s` seconds, `max_tries` checks when given,
    `interval_s` seconds between them. The first check is made at once."""
    pace = Pace(timeout_s, interval_s, max_tries)
    while not await check():
        pause_s = pace.next_pause_s()
        if pause_s is None:
            return False
        await asyncio.sleep(pause_s)
    return True


def poll_until_sync(
    check: Callable[[], bool],
    *,
    timeout_s: float,
    interval_s: float,
    max_tries: int | None = None,
) -> bool:
    """`poll_until` for a plain `check`, sleeping the thread between checks."""
    pace = Pace(timeout_s, interval_s, max_tries)
    while not check():
        pause_s = pace.next_pause_s()
        if pause_s is None:
            return False
        time.sleep(pause_s)
    return True
