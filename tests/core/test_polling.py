"""The one bounded poll (lorafleet.polling): a count bound, a time bound,
the first check at once, the last one at the deadline, errors propagated."""

from __future__ import annotations

import pytest

from lorafleet.polling import Pace, poll_until, poll_until_sync


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def test_the_time_bound_ends_with_a_check_at_the_deadline() -> None:
    clock = FakeClock()
    pace = Pace(timeout_s=1.0, interval_s=0.4, clock=clock)
    pauses = []
    while (pause_s := pace.next_pause_s()) is not None:
        pauses.append(pause_s)
        clock.now_s += pause_s
    # 0.4, 0.4, then the 0.2 left: a fourth check lands on the deadline, no fifth.
    assert pauses == pytest.approx([0.4, 0.4, 0.2])
    assert pace.tries == 4


def test_the_count_bound_ends_before_the_time_bound() -> None:
    clock = FakeClock()
    pace = Pace(timeout_s=60.0, interval_s=0.1, max_tries=3, clock=clock)
    assert [pace.next_pause_s(), pace.next_pause_s(), pace.next_pause_s()] == [0.1, 0.1, None]


def test_a_count_of_nothing_is_refused_saying_what_to_give() -> None:
    with pytest.raises(ValueError, match="give at least 1"):
        Pace(timeout_s=1.0, interval_s=0.1, max_tries=0)


async def test_answers_true_on_the_first_yes() -> None:
    calls: list[int] = []

    async def third_time() -> bool:
        calls.append(1)
        return len(calls) == 3

    assert await poll_until(third_time, timeout_s=30.0, interval_s=0)
    assert len(calls) == 3


async def test_answers_false_when_the_count_is_spent() -> None:
    calls: list[int] = []

    async def never() -> bool:
        calls.append(1)
        return False

    assert not await poll_until(never, timeout_s=30.0, interval_s=0, max_tries=5)
    assert len(calls) == 5


def test_sync_answers_false_at_the_time_bound_and_true_on_yes() -> None:
    calls: list[int] = []

    def never() -> bool:
        calls.append(1)
        return False

    assert not poll_until_sync(never, timeout_s=0.05, interval_s=0.01)
    assert calls  # the first check is made at once, whatever the bound
    assert poll_until_sync(lambda: True, timeout_s=0.0, interval_s=1.0)


def test_errors_from_the_check_propagate() -> None:
    def died() -> bool:
        raise RuntimeError("vLLM exited 1 while starting")

    with pytest.raises(RuntimeError, match="exited 1"):
        poll_until_sync(died, timeout_s=30.0, interval_s=0.1)
