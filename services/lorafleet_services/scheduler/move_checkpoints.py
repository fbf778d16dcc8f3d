"""A drained node's training moves with a checkpoint taken at the move.

Moved with its newest stored checkpoint, a job would lose every step since
(the trainer checkpoints every `checkpoint_every_s`, 600 s by default, or
every `checkpoint_every_steps`). So before a job moves off a node drained
with move_training, the leader asks that node's agent for a checkpoint
after the trainer's next step (`lorafleet.node.<node>.checkpoint`), and
moves the job once the recorder holds a checkpoint at least as new as the
step the job had reached when asked. What is lost is the steps between
that checkpoint and the cancel: a round or two (`RECONCILE_EVERY_S`).

A trainer that cannot checkpoint (a stand-in without a checkpoint
directory, an agent that does not run the job any more or is older than
this request) answers so, and the job moves at once; one whose checkpoint
does not come (its delivery failed) moves after `CHECKPOINT_WAIT_S`, as it
did before: from its newest stored checkpoint.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass, field
from typing import Any, Protocol

import nats.errors

from lorafleet.errors import ApiError
from lorafleet.log import Event
from lorafleet_schemas.messages import (
    JobRecord,
    NodeCheckpointReply,
    NodeCheckpointRequest,
)

#: Seconds a move waits for the checkpoint it asked for: a step, the write
#: of the adapter's weights and optimizer state, their delivery and the
#: recorder's record. Past it the job moves from its newest checkpoint.
CHECKPOINT_WAIT_S = 60.0


class CheckpointAsking(Protocol):
    async def checkpoint(self, node: str, req: NodeCheckpointRequest) -> NodeCheckpointReply: ...


def steps_since_checkpoint(job: JobRecord) -> int:
    """Steps `job` would lose, moved now (its step as last reported)."""
    return max(0, job.step - (job.checkpoint.step if job.checkpoint is not None else 0))


@dataclass
class MoveCheckpoints:
    """Which moving jobs may go now (`ready`), asking their nodes for a
    checkpoint first. `now`: monotonic seconds; `agents`: AgentRequests."""

    agents: CheckpointAsking
    logger: Any
    wait_s: float = CHECKPOINT_WAIT_S
    #: job id -> (monotonic seconds when asked, the job's step then); a node
    #: that could not take the ask is recorded as asked `wait_s` ago.
    asked: dict[str, tuple[float, int]] = field(default_factory=dict)

    async def ready(
        self, moving: Sequence[JobRecord], now: float, skip: Set[str] = frozenset()
    ) -> list[JobRecord]:
        """The jobs of `moving` (but those in `skip`) that move now: each has
        nothing to lose, or the checkpoint asked for is stored, or its wait
        is over. A job's node is asked the first time it is seen; the asks
        of jobs no longer moving (moved, finished) are forgotten."""
        moving = [j for j in moving if j.id not in skip]
        self.asked = {j.id: self.asked[j.id] for j in moving if j.id in self.asked}
        out = []
        for job in moving:
            if steps_since_checkpoint(job) == 0:
                out.append(job)
                continue
            if job.id not in self.asked:
                await self._ask(job, now)
            asked_at, step = self.asked[job.id]
            newest = job.checkpoint.step if job.checkpoint is not None else 0
            if newest >= step or now - asked_at >= self.wait_s:
                out.append(job)
        return out

    async def _ask(self, job: JobRecord, now: float) -> None:
        node = job.node or ""
        req = NodeCheckpointRequest(job_id=job.id, attempt=job.attempt)
        try:
            reply = await self.agents.checkpoint(node, req)
            why = reply.reason
        except (ApiError, TimeoutError, nats.errors.Error) as e:
            reply, why = NodeCheckpointReply(asked=False), str(e)
        self.asked[job.id] = (now if reply.asked else now - self.wait_s, job.step)
        self.logger.info(
            Event.JOB_CHECKPOINT_ASKED,
            job_id=job.id,
            node=node,
            step=job.step,
            asked=reply.asked,
            message=why,
        )
