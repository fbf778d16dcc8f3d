"""stop_tasks: a task that swallows its cancellation is cancelled again until it
ends. within: wait_for that ends what it bounds even where Python 3.11's loses
the cancellation. at_most: a few at a time, none left running when one fails.
The test harness stops what a test leaves running the same way."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lorafleet._tasks import at_most, stop_tasks, within

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[2]


async def loses_one_cancellation(lost: list[int] | None = None) -> None:
    """nats.connect against a server that refuses it: attempts in a loop,
    each awaited through asyncio.wait_for, which on 3.11 loses a cancellation
    that lands as an attempt's future completes (gh-86296) and goes on, as
    here (noted in `lost`); asyncio.wait_for(loses_one_cancellation(), t)
    never returns."""
    lost = [] if lost is None else lost
    while True:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            if lost:
                raise
            lost.append(1)


async def test_a_task_that_swallows_one_cancel_is_stopped_all_the_same() -> None:
    swallowed: list[int] = []
    task = asyncio.create_task(loses_one_cancellation(swallowed))
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_tasks(task, None), 5)
    assert task.cancelled() and swallowed == [1]


async def test_within_ends_a_call_that_loses_its_cancellation() -> None:
    bounded = asyncio.ensure_future(within(0.01, loses_one_cancellation()))
    done, _ = await asyncio.wait({bounded}, timeout=5)
    if not done:
        await stop_tasks(bounded)
    assert done, "within() did not end what it bounds"
    with pytest.raises(TimeoutError, match=r"not done within 0\.01 s"):
        bounded.result()


async def test_within_gives_the_result_and_the_error_of_a_call_in_time() -> None:
    async def answer() -> int:
        await asyncio.sleep(0)
        return 42

    async def boom() -> None:
        raise ValueError("refused")

    assert await within(5, answer()) == 42
    with pytest.raises(ValueError, match="refused"):
        await within(5, boom())


async def test_within_cancelled_by_its_caller_ends_its_call() -> None:
    started = asyncio.Event()

    async def waits() -> None:
        started.set()
        await asyncio.sleep(10)

    call = waits()
    caller = asyncio.ensure_future(within(10, call))
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert call.cr_frame is None  # the coroutine ended (closed), not left behind


async def test_failed_and_finished_tasks_are_fine() -> None:
    async def boom() -> None:
        raise ValueError("ended badly")

    failed = asyncio.create_task(boom())
    done = asyncio.create_task(asyncio.sleep(0))
    await asyncio.sleep(0.01)
    await stop_tasks(failed, done)
    assert failed.done() and done.done()


async def test_at_most_runs_width_at_once_and_raises_after_all_ended() -> None:
    running, most, ended = [0], [0], []

    async def call(i: int) -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await asyncio.sleep(0.01)
        running[0] -= 1
        ended.append(i)
        if i == 1:
            raise ValueError("the second call failed")

    with pytest.raises(ValueError, match="the second call failed"):
        await at_most(3, [call(i) for i in range(7)])
    assert most[0] == 3 and sorted(ended) == list(range(7))


LEFT_BEHIND = """
import asyncio
from pathlib import Path

from tests.conftest import _leftover_tasks_stopped  # noqa: F401 (the guard under test)

async def stubborn(record: Path) -> None:
    while True:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            if record.exists():
                record.write_text("stopped")
                raise
            record.write_text("swallowed")  # a lost cancellation, as the loop sees it

async def test_leaves_a_task_behind() -> None:
    asyncio.create_task(stubborn(Path(__file__).parent / "record"))
    await asyncio.sleep(0)
"""


def test_a_task_a_test_leaves_that_loses_one_cancel_does_not_hang_its_session(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/conftest.py's guard: pytest-asyncio closes a test's loop with one
    cancel per leftover task and waits for it without a bound (without the
    guard this inner session fails on its 10 s timeout)."""
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    pytester.makeini(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    pytester.makepyfile(test_left=LEFT_BEHIND)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--timeout", "10")
    result.assert_outcomes(passed=1)
    assert (pytester.path / "record").read_text() == "stopped"
