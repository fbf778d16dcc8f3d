"""`api.adapters.serve` and `api.adapters.unserve`: a done job's adapter onto
(or off) a node's engines.

Answered by any replica. The checks are plain functions over the job and
the node table (`job_refusal`, `node_refusal`, `engine_refusal`,
`unserve_targets`); then the agent is sent `node.<node>.serve` and its
answer is the reply; each engine's outcome follows as a ServingReport the
recorder keeps. An agent that does not answer is an UnavailableError
naming the node; nothing is recorded for it, so a request sent again is
safe (docs/fine-tune-and-serve.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors

from lorafleet import metrics
from lorafleet._recorder_client import RecorderClient
from lorafleet.errors import (
    ApiError,
    BadRequestError,
    ConflictError,
    NotFoundError,
    UnavailableError,
)
from lorafleet.log import Event
from lorafleet.states import FINAL
from lorafleet_schemas.messages import (
    LIST_MAX,
    AdapterListRequest,
    AdapterServeRequest,
    AdapterUnserveReply,
    AdapterUnserveRequest,
    JobRecord,
    JobState,
    NodeServeReply,
    NodeServeRequest,
    NodeUnserveRequest,
    ServingRecord,
    ServingState,
)
from lorafleet_services.scheduler.dispatch import AgentRequests
from lorafleet_services.scheduler.node_table import Node, NodeTable, utc_hms


def no_job(job_id: str) -> NotFoundError:
    return NotFoundError(f"no job {job_id}: list jobs with `lorafleet jobs`", "$.job_id")


def job_refusal(job_id: str, job: JobRecord | None) -> ApiError | None:
    """Why `job` cannot be served (None: it can): unknown, not done, no adapter."""
    if job is None:
        return no_job(job_id)
    if job.state is not JobState.DONE and job.state in FINAL:
        return ConflictError(
            f"job {job.id} ended {job.state.value}, so it has no finished adapter to serve: "
            f"submit it again (or `lorafleet resume {job.id}`) and serve it once done",
            "$.job_id",
        )
    if job.state is not JobState.DONE:
        return ConflictError(
            f"job {job.id} is {job.state.value}: an adapter is served once its job is done; "
            f"wait for it (`lorafleet follow {job.id}`), then serve it",
            "$.job_id",
        )
    if job.adapter is None:
        return ConflictError(
            f"job {job.id} is done but the recorder holds no stored PEFT adapter for it "
            "(a job recorded before adapters were kept): train it again to serve it",
            "$.job_id",
        )
    return None


def node_refusal(name: str, node: Node | None) -> UnavailableError | None:
    """Why `name` cannot be asked now (None: it can): never heard, or lost."""
    if node is None:
        return UnavailableError(
            f"node {name} has sent no heartbeat this scheduler knows of: start its agent, "
            "or name a live node (`lorafleet nodes`)",
            "$.node",
        )
    if not node.alive:
        return UnavailableError(
            f"node {name} is not alive (last heartbeat {utc_hms(node.heartbeat.time)}): "
            "start its agent again, or name another node with --node",
            "$.node",
        )
    return None


def engine_refusal(node: Node, engine: str | None) -> BadRequestError | None:
    """An engine named that the node's heartbeat does not list."""
    urls = [e.url for e in node.heartbeat.serving]
    if engine is None or engine in urls:
        return None
    runs = ", ".join(urls) if urls else "none"
    return BadRequestError(
        f"node {node.name} runs no engine at {engine}; the engines it runs: {runs} "
        "(`lorafleet top`)",
        "$.engine",
    )


def serve_node(job: JobRecord, req: AdapterServeRequest) -> str:
    """The node a serve goes to: the one named, else where the job trained."""
    node = req.node or job.node
    if node is None:
        raise BadRequestError(f"job {job.id} ran on no node: name one with --node", "$.node")
    return node


def unserve_targets(records: list[ServingRecord], req: AdapterUnserveRequest) -> list[str]:
    """The nodes an unserve goes to: the one named, else each with a record
    (of the engine named, if one is) not unloaded yet."""
    if req.node is not None:
        return [req.node]
    return sorted(
        {
            r.node
            for r in records
            if r.state is not ServingState.UNLOADED and req.engine in (None, r.engine)
        }
    )


class ServeHandlers:
    """The serve and unserve handlers over the recorder, the agents and the node table."""

    def __init__(
        self, recorder: RecorderClient, agents: AgentRequests, table: NodeTable, logger: Any
    ) -> None:
        self.recorder = recorder
        self.agents = agents
        self.table = table
        self.logger = logger

    def _refused(self, request: str, job_id: str, node: str | None, error: ApiError) -> ApiError:
        metrics.SERVE_REQUESTS.labels(request, "refused").inc()
        self.logger.info(
            Event.SERVE_REQUESTED,
            job_id=job_id,
            node=node,
            outcome="refused",
            message=error.message,
        )
        return error

    def _live_node(self, name: str) -> Node:
        """The node `name`, alive; else node_refusal's UnavailableError."""
        node = self.table.nodes.get(name)
        if node is None or not node.alive:
            raise node_refusal(name, node) or UnavailableError(name)
        return node

    async def _job(self, job_id: str) -> JobRecord | None:
        """The job, as the recorder has it; a refusal of the id is this request's `$.job_id`."""
        try:
            return await self.recorder.get_job(job_id)
        except BadRequestError as e:
            raise BadRequestError(e.message, "$.job_id") from None

    async def serve(self, req: AdapterServeRequest) -> NodeServeReply:
        job = await self._job(req.job_id)
        try:
            refusal = job_refusal(req.job_id, job)
            if refusal is not None or job is None or job.adapter is None:
                raise refusal or NotFoundError(req.job_id)
            name = serve_node(job, req)
            engine_error = engine_refusal(self._live_node(name), req.engine)
            if engine_error is not None:
                raise engine_error
            model = {m.name: m for m in await self.recorder.models()}.get(job.model)
            if model is None:
                raise NotFoundError(
                    f"model {job.model} of job {job.id} is no longer in the catalog: add it "
                    "again (`lorafleet models add`), then serve the job",
                    "$.job_id",
                )
        except ApiError as e:
            raise self._refused("serve", req.job_id, req.node, e) from None
        ask = NodeServeRequest(
            job_id=job.id,
            model=model,
            object=job.adapter.object,
            sha256=job.adapter.sha256,
            engine=req.engine,
        )
        return await self._ask("serve", name, job.id, self.agents.serve(name, ask))

    async def unserve(self, req: AdapterUnserveRequest) -> AdapterUnserveReply:
        job = await self._job(req.job_id)
        if job is None:
            raise self._refused("unserve", req.job_id, req.node, no_job(req.job_id))
        records = await self.recorder.adapters(
            AdapterListRequest(job_id=job.id, node=req.node, limit=LIST_MAX)
        )
        targets = unserve_targets(records, req)
        if not targets:
            error = NotFoundError(
                f"job {job.id} is served nowhere, so there is nothing to unserve "
                f"(`lorafleet adapters --job {job.id}` lists its records)",
                "$.job_id",
            )
            raise self._refused("unserve", job.id, req.node, error)
        if req.node is not None:
            try:
                self._live_node(req.node)
            except ApiError as e:
                raise self._refused("unserve", job.id, req.node, e) from None
        ask = NodeUnserveRequest(job_id=job.id, engine=req.engine)
        replies = await asyncio.gather(*(self._unserve_one(n, ask) for n in targets))
        return AdapterUnserveReply(replies=list(replies))

    async def _unserve_one(self, name: str, ask: NodeUnserveRequest) -> NodeServeReply:
        """One node's answer; a node lost or silent answers with why (the others go on)."""
        try:
            self._live_node(name)
            return await self._ask("unserve", name, ask.job_id, self.agents.unserve(name, ask))
        except ApiError as e:
            return NodeServeReply(node=name, reason=e.message)

    async def _ask(self, request: str, node: str, job_id: str, sent: Any) -> NodeServeReply:
        """Await the agent's answer to `sent`; no answer is an UnavailableError."""
        try:
            reply: NodeServeReply = await sent
        except (TimeoutError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as e:
            metrics.SERVE_REQUESTS.labels(request, "unanswered").inc()
            no_one = isinstance(e, nats.errors.NoRespondersError)
            message = (
                f"the agent on node {node} " + ("does not take serve requests (no responder)"
                if no_one else "did not answer in time") + f": check it runs (`lorafleet "
                f"nodes`) and send the {request} again"
            )  # fmt: skip
            self.logger.warning(
                Event.SERVE_REQUESTED, job_id=job_id, node=node, outcome="unanswered",
                message=message,
            )  # fmt: skip
            raise UnavailableError(message, "$.node") from None
        except ApiError as e:
            # The agent's own refusal travels to the caller as it said it.
            raise self._refused(request, job_id, node, e) from None
        metrics.SERVE_REQUESTS.labels(request, "sent").inc()
        reply.node = reply.node or node
        self.logger.info(
            Event.SERVE_REQUESTED, job_id=job_id, node=node, outcome="sent",
            message=f"{request}: engines {', '.join(reply.engines) or 'none'} {reply.reason}",
        )  # fmt: skip
        return reply
