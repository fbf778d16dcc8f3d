"""The leader's replica pass: the desired placement of every done job with a
serving policy (replicas.py) reconciled onto the nodes, each round.

Read: the done jobs a serving policy places (every page: the recorder
filters them, `JobListRequest.placed`), the catalog, their serving records
(an answer the recorder's cap filled is asked again in halves) and the node
table (the heartbeats, the marks). Decide: `plan_replicas`.
Apply: `node.<node>.serve` (placed) and `.unserve` through the same
`AgentRequests` as `api.adapters.serve`, sent off the round. A (job, node)
asked is not asked again for a while (`replicas.Asks`): a load takes a
while, and a refused one is not hammered; a node that started nothing is
asked again soon.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import Callable, Coroutine
from typing import Any

from lorafleet._recorder_client import RecorderClient, serving_records
from lorafleet._tasks import stop_tasks
from lorafleet.errors import ApiError
from lorafleet.fleet_serving import policy_of
from lorafleet.log import Event
from lorafleet_schemas.messages import (
    LIST_MAX,
    JobListRequest,
    JobRecord,
    JobState,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
)
from lorafleet_services.scheduler.dispatch import AgentRequests
from lorafleet_services.scheduler.node_table import NodeTable
from lorafleet_services.scheduler.replicas import AskKey, Asks, Placed, plan_replicas

#: Most pages of placed done jobs (LIST_MAX each) one pass reads; past
#: them the oldest are left out of the pass, and a warning says so.
MAX_PLACED_PAGES = 50
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
        self.asks = Asks()
        self._background: set[asyncio.Task[Any]] = set()
        self._last_pass = -IDLE_EVERY_S
        self._idle = False
        self._nudged = False

    async def stop(self) -> None:
        await stop_tasks(*self._background)

    async def placed_jobs(self) -> list[Placed]:
        """The done jobs with a stored adapter and a serving policy."""
        (jobs, complete), catalog = await asyncio.gather(
            placed_done_jobs(self.recorder), self.recorder.models()
        )
        if not complete:
            self.logger.warning(
                Event.LISTING_CAPPED, message=f"more than {len(jobs)} done jobs with a "
                "serving policy: the oldest are not placed this pass",
            )  # fmt: skip
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
        records = await serving_records(self.recorder.adapters, [p.job.id for p in placed])
        self.asks.heard(records, now)
        wall = dt.datetime.now(dt.UTC)
        asked = self.asks.pending("place", now)
        plan = plan_replicas(placed, self.table.nodes, records, asked, wall)
        by_id = {p.job.id: p for p in placed}
        for job_id, node in plan.place:
            self.asks.ask((job_id, node, "place"), now, wall)
            self._spawn(self._place(by_id[job_id], node))
        unplacing = self.asks.pending("unplace", now)
        for job_id, node in (p for p in plan.unplace if p not in unplacing):
            self.asks.ask((job_id, node, "unplace"), now, wall)
            request = NodeUnserveRequest(job_id=job_id)
            self._spawn(self._ask("unplace", job_id, node, self.agents.unserve(node, request)))

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
        key: AskKey = (job_id, node, what)
        try:
            reply = await sent
            message = f"engines {', '.join(reply.engines) or 'none'} {reply.reason}".strip()
            if not reply.engines:
                self.asks.not_started(key, self.clock())
        except (ApiError, Exception) as e:
            message = f"not answered: {e!r}"
            self.asks.not_started(key, self.clock())
        self.logger.info(Event.REPLICA_PLACED, job_id=job_id, node=node, state=what,
                         message=message)  # fmt: skip

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def placed_done_jobs(recorder: RecorderClient) -> tuple[list[JobRecord], bool]:
    """The done jobs a serving policy places, newest first, page after page
    (at most MAX_PLACED_PAGES); and whether that was all of them."""
    out: list[JobRecord] = []
    after: str | None = None
    for _ in range(MAX_PLACED_PAGES):
        req = JobListRequest(state=JobState.DONE, placed=True, limit=LIST_MAX, after=after)
        page = await recorder.list_jobs(req)
        out.extend(page)
        if len(page) < LIST_MAX:
            return out, True
        after = page[-1].id
    return out, False
