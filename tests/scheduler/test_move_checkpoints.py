"""The checkpoint a drained node's job takes before it moves
(scheduler/move_checkpoints.py): plain, with a stand-in for the agent's answer."""

from __future__ import annotations

import structlog

from lorafleet.errors import UnavailableError
from lorafleet_schemas.messages import (
    ArtifactKind,
    CheckpointRef,
    JobRecord,
    JobState,
    NodeCheckpointReply,
    NodeCheckpointRequest,
)
from lorafleet_services.scheduler.move_checkpoints import CHECKPOINT_WAIT_S, MoveCheckpoints
from tests.records import job_record


class Agents:
    """Answers each checkpoint ask with `reply` (an exception is raised)."""

    def __init__(self, reply: NodeCheckpointReply | Exception) -> None:
        self.reply = reply
        self.asks: list[tuple[str, NodeCheckpointRequest]] = []

    async def checkpoint(self, node: str, req: NodeCheckpointRequest) -> NodeCheckpointReply:
        self.asks.append((node, req))
        if isinstance(self.reply, Exception):
            raise self.reply
        return self.reply


def running(step: int, checkpoint_step: int | None = None) -> JobRecord:
    checkpoint = None
    if checkpoint_step is not None:
        checkpoint = CheckpointRef(
            job_id="j", kind=ArtifactKind.CHECKPOINT, step=checkpoint_step, object="j/checkpoint",
            size=1, sha256="0" * 64,
        )  # fmt: skip
    return job_record(id="j", node="n1", state=JobState.RUNNING, step=step, attempt=2,
                      checkpoint=checkpoint)  # fmt: skip


def moves(reply: NodeCheckpointReply | Exception) -> tuple[MoveCheckpoints, Agents]:
    agents = Agents(reply)
    return MoveCheckpoints(agents, structlog.get_logger()), agents


async def test_a_job_moves_once_the_checkpoint_asked_for_is_stored() -> None:
    m, agents = moves(NodeCheckpointReply(asked=True))
    assert await m.ready([running(step=23, checkpoint_step=20)], now=0.0) == []
    assert agents.asks == [("n1", NodeCheckpointRequest(job_id="j", attempt=2))]
    # Asked once: later rounds wait for the checkpoint, without asking again.
    assert await m.ready([running(step=25, checkpoint_step=20)], now=1.0) == []
    assert len(agents.asks) == 1
    stored = running(step=25, checkpoint_step=24)
    assert await m.ready([stored], now=2.0) == [stored]


async def test_a_checkpoint_that_does_not_come_is_waited_for_a_bounded_time() -> None:
    m, _ = moves(NodeCheckpointReply(asked=True))
    job = running(step=23, checkpoint_step=20)
    assert await m.ready([job], now=0.0) == []
    assert await m.ready([job], now=CHECKPOINT_WAIT_S - 0.1) == []
    assert await m.ready([job], now=CHECKPOINT_WAIT_S) == [job]


async def test_nothing_to_lose_moves_at_once_and_asks_nothing() -> None:
    m, agents = moves(NodeCheckpointReply(asked=True))
    at_checkpoint, preparing = running(step=20, checkpoint_step=20), running(step=0)
    assert await m.ready([at_checkpoint, preparing], now=0.0) == [at_checkpoint, preparing]
    assert agents.asks == []


async def test_a_node_that_cannot_take_the_ask_moves_the_job_at_once() -> None:
    for answer in (
        NodeCheckpointReply(asked=False, reason="its trainer has not started"),
        UnavailableError("no responders"),
        TimeoutError(),
    ):
        m, agents = moves(answer)
        job = running(step=23)
        assert await m.ready([job], now=0.0) == [job], answer
        assert len(agents.asks) == 1


async def test_asks_are_forgotten_once_a_job_is_not_moving() -> None:
    m, agents = moves(NodeCheckpointReply(asked=True))
    job = running(step=23, checkpoint_step=20)
    await m.ready([job], now=0.0)
    await m.ready([], now=1.0)  # moved, or finished
    assert m.asked == {}
    await m.ready([job], skip={"j"}, now=2.0)  # failed with its node this round
    assert m.asked == {} and len(agents.asks) == 1
