"""The leader's replica pass: the desired placement of every done job with a
serving policy (replicas.py) reconciled onto the nodes, each round.

Read: the done jobs, the catalog, the jobs' serving records (the recorder)
and the node table (the heartbeats, the marks). Decide: `plan_replicas`.
Apply: `node.<node>.serve` (placed) and `.unserve` through the same
`AgentRequests` as `api.adapters.serve`, sent off the round. A (job, node)
asked is not asked again for `ASK_AGAIN_S` unless a record or a beat
answers first: a load takes a while, and a refused one is not hammered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from lorafleet._recorder_client import RecorderClient
from lorafleet._tasks import stop_tasks
from lorafleet.errors import ApiError
from lorafleet.fleet_serving import policy_of
from lorafleet.log import Event
from lorafleet_schemas.messages import (
    AdapterListRequest,
    JobListRequest,
    JobState,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
)
from lorafleet_services.scheduler.dispatch import LIST_LIMIT, AgentRequests
from lorafleet_services.scheduler.node_table import NodeTable
from lorafleet_services.scheduler.replicas import Placed, plan_replicas

#: Seconds before a (job, node) asked to load or unload is asked again when
#: nothing answered it: past a load and its probe on a busy node, short
#: enough that a refused load is tried again soon after its cause is lifted.
ASK_AGAIN_S = 30.0
#: Most serving records one pass reads (the recorder's cap).
RECORDS_LIMIT = 1000
#: Seconds between two passes at least (rounds run more often when woken).
PLACE_EVERY_S = 1.0
#: Seconds between two passes while the last found no job with a policy (a
#: fleet that uses none pays one jobs list per this); a job's `done` event
#: makes the next round pass at once (`nudge`).
IDLE_EVERY_S = 10.0


class ReplicaRounds:
    """Keeps each policy's replicas placed (module doc). clock: monotonic seconds."""

    def __init__(
        self,
        recorder: RecorderClient,
        agents: AgentRequests,
        table: NodeTable,
        clock: Callable[[], float],
        logger: Any,
    ) -> None:
        self.recorder = recorder
        self.agents = agents
        self.table = table
        self.clock = clock
        self.logger = logger
        #: (job, node, "place" | "unplace") -> monotonic seconds when asked.
        self.asked: dict[tuple[str, str, str], float] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._last_pass = -IDLE_EVERY_S
        self._idle = False
        self._nudged = False

    async def stop(self) -> None:
        await stop_tasks(*self._background)

    async def placed_jobs(self) -> list[Placed]:
        """The done jobs with a stored adapter and a serving policy."""
        jobs, catalog = await asyncio.gather(
            self.recorder.list_jobs(JobListRequest(state=JobState.DONE, limit=LIST_LIMIT)),
            self.recorder.models(),
        )
        models = {m.name: m for m in catalog}
        out: list[Placed] = []
        for job in jobs:
            model = models.get(job.model)
            policy = policy_of(job, model)
            if model is not None and policy is not None and job.adapter is not None:
                out.append(Placed(job, model, policy))
        return out

    def nudge(self) -> None:
        """A job ended done: the next round passes, however idle."""
        self._nudged = True

    async def round(self, now: float) -> None:
        every_s = IDLE_EVERY_S if self._idle and not self._nudged else PLACE_EVERY_S
        if now - self._last_pass < every_s:
            return
        self._last_pass, self._nudged = now, False
        placed = await self.placed_jobs()
        self._idle = not placed
        if not placed:
            return
        records = await self.recorder.adapters(
            AdapterListRequest(job_ids=[p.job.id for p in placed], limit=RECORDS_LIMIT)
        )
        self.asked = {k: t for k, t in self.asked.items() if now - t < ASK_AGAIN_S}
        plan = plan_replicas(placed, self.table.nodes, records, self._asked("place"))
        by_id = {p.job.id: p for p in placed}
        for job_id, node in plan.place:
            self.asked[(job_id, node, "place")] = now
            self._spawn(self._place(by_id[job_id], node))
        for job_id, node in plan.unplace:
            if (job_id, node, "unplace") in self.asked:
                continue
            self.asked[(job_id, node, "unplace")] = now
            request = NodeUnserveRequest(job_id=job_id)
            self._spawn(self._ask("unplace", job_id, node, self.agents.unserve(node, request)))

    def _asked(self, what: str) -> set[tuple[str, str]]:
        return {(job, node) for job, node, kind in self.asked if kind == what}

    async def _place(self, placed: Placed, node: str) -> None:
        adapter = placed.job.adapter
        if adapter is None:
            return
        request = NodeServeRequest(
            job_id=placed.job.id,
            model=placed.model,
            object=adapter.object,
            sha256=adapter.sha256,
            placed=True,
        )
        await self._ask("place", placed.job.id, node, self.agents.serve(node, request))

    async def _ask(
        self, what: str, job_id: str, node: str, sent: Coroutine[Any, Any, NodeServeReply]
    ) -> None:
        try:
            reply = await sent
            message = f"engines {', '.join(reply.engines) or 'none'} {reply.reason}".strip()
        except (ApiError, Exception) as e:  # the next pass after ASK_AGAIN_S asks again
            message = f"not answered: {e!r}"
        self.logger.info(Event.REPLICA_PLACED, job_id=job_id, node=node, state=what,
                         message=message)  # fmt: skip

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
