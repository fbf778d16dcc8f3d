"""What the scheduler does when a node's agent refuses a start, or never answers
it. The "agent" here is a real heartbeat publisher and a real responder on the
node's start subject, so that the refusal and the silence are certain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from nats.aio.msg import Msg

from lorafleet.nats import _bus as bus
from lorafleet_schemas.messages import JobState, StartReply
from tests.system.conftest import Stack

Responder = Callable[[Msg], Awaitable[None]]


@pytest.fixture
async def node_with(stack: Stack) -> AsyncIterator[Callable[[str, Responder], Awaitable[None]]]:
    """Start a fake CPU node `name` whose start requests go to `responder`."""
    stops: list[asyncio.Event] = []
    tasks: list[asyncio.Task[None]] = []

    async def make(name: str, responder: Responder) -> None:
        await stack.nc.subscribe(stack.settings.names.node_start(name), cb=responder)
        stop = asyncio.Event()
        stops.append(stop)
        tasks.append(asyncio.create_task(stack.fake_node(name, [], stop, cpu=True)))

    yield make
    for stop in stops:
        stop.set()
    await asyncio.gather(*tasks)


async def test_a_start_the_agent_refuses_fails_the_job_with_its_reason(
    stack: Stack, node_with: Callable[[str, Responder], Awaitable[None]]
) -> None:
    received: list[str] = []

    async def refuse(msg: Msg) -> None:
        received.append(msg.subject)
        reply = StartReply(accepted=False, reason="the disk is full")
        await msg.respond(bus.encode(reply))

    await node_with("grumpy", refuse)
    await stack.add_model()
    job = await stack.submit("grumpy")
    failed = await stack.wait_state(job.id, JobState.FAILED, timeout_s=10)
    assert failed.message == "the agent on grumpy did not accept the job: the disk is full"
    assert len(received) == 1


async def test_a_start_nobody_answers_is_left_to_reconcile(
    stack: Stack, node_with: Callable[[str, Responder], Awaitable[None]]
) -> None:
    received: list[str] = []

    async def silent(msg: Msg) -> None:
        received.append(msg.subject)

    await node_with("mute", silent)
    await stack.add_model()
    job = await stack.submit("mute")
    await stack.wait_state(job.id, JobState.STARTING, timeout_s=10)
    # Not failed on the timeout itself: the agent might have taken it.
    failed = await stack.wait_state(job.id, JobState.FAILED, timeout_s=15)
    assert "the agent on mute" in failed.message and "never received it" in failed.message
    # Sent once; a leader that takes over a `starting` job it did not send
    # sends it once more, same attempt (Dispatcher._resend): on a loaded
    # machine the lead can change hands in these seconds.
    assert 1 <= len(received) <= 2, received
