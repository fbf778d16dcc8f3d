"""The shared wait helper: returns the accepted value, fails saying what it saw."""

from __future__ import annotations

import pytest

from tests.eventually import NeverHappenedError, eventually


async def test_returns_the_first_accepted_value() -> None:
    calls: list[int] = []

    def count() -> int:
        calls.append(1)
        return len(calls)

    assert await eventually(count, "three calls", until=lambda n: n >= 3, interval_s=0) == 3


async def test_async_checks_and_retried_errors() -> None:
    seen: list[int] = []

    async def flaky() -> str:
        seen.append(1)
        if len(seen) < 3:
            raise LookupError("not yet")
        return "there"

    assert await eventually(flaky, "a value", retry_on=(LookupError,), interval_s=0) == "there"


async def test_times_out_naming_what_and_the_last_value() -> None:
    with pytest.raises(NeverHappenedError, match=r"waiting for the answer; last saw 41"):
        await eventually(lambda: 41, "the answer", until=lambda n: n == 42, timeout_s=0.05)


async def test_other_errors_propagate() -> None:
    def broken() -> int:
        raise ValueError("bug")

    with pytest.raises(ValueError, match="bug"):
        await eventually(broken, "anything", retry_on=(LookupError,))
