"""stop_tasks: a task that swallows its cancellation is cancelled again until it
ends. at_most: a few at a time, none left running when one fails."""

from __future__ import annotations

import asyncio

import pytest

from lorafleet._tasks import at_most, stop_tasks


async def test_a_task_that_swallows_one_cancel_is_stopped_all_the_same() -> None:
    swallowed: list[int] = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if swallowed:
                    raise
                swallowed.append(1)  # what a lost cancellation looks like to the loop

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_tasks(task, None), 5)
    assert task.cancelled() and swallowed == [1]


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
